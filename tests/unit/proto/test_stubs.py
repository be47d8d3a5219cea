"""The committed stubs are what the .proto generates: editing the contract without regenerating fails."""

from proto.codegen import OUTPUTS, PROTO, ROOT, generate


def test_committed_stubs_match_the_proto(tmp_path):
    fresh = generate(tmp_path)
    assert [path.name for path in fresh] == list(OUTPUTS)
    committed = ROOT / PROTO
    for path in fresh:
        mine = committed.parent / path.name
        assert mine.exists(), f"{mine} is missing: run `python -m proto.codegen`"
        assert mine.read_bytes() == path.read_bytes(), f"{mine.name} is stale: run `python -m proto.codegen`"


def test_stale_stubs_are_detected(tmp_path):
    # The check above must be able to fail: a changed contract generates different stubs.
    fresh = generate(tmp_path)[0].read_bytes()
    edited = (ROOT / PROTO).read_text().replace("uint32 layer = 2;", "uint32 layer_index = 2;")
    assert edited != (ROOT / PROTO).read_text()
    from grpc_tools import protoc

    source = tmp_path / "edited" / PROTO
    source.parent.mkdir(parents=True)
    source.write_text(edited)
    out = tmp_path / "out"
    out.mkdir()
    assert protoc.main(["protoc", f"-I{tmp_path / 'edited'}", f"--python_out={out}", str(source)]) == 0
    assert (out / "proto/lazyserve/v1/lazyserve_pb2.py").read_bytes() != fresh
