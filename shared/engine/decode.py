"""One decode step with LazyLLM's per-step re-selection and revival from the Aux Cache.

The new token runs through every layer. Under `lazy`, each stage layer scores the live prompt
tokens by the attention of the new token and the query window before it (the configured
`window`; 1 is the new token alone) and keeps the top fraction (generated tokens are always kept).
A kept token that has no KV at the next layer stopped exactly at this one, so its hidden state is
in this layer's Aux Cache: it is revived from there and computed onward, layer by layer, together
with the new token, until it is dropped again (back into the Aux Cache) or reaches the last layer.
Under `static`, `random` and `off`, the live set at each layer is whatever has KV there.
"""

from __future__ import annotations

import torch

from shared.engine.cache import LazyCache, QueryWindow
from shared.engine.layer import attend, finish, logits_of, project_qkv, window_scores
from shared.engine.model import EngineModel
from shared.engine.pruning import PruneConfig, ScoreInputs, scorer_for, select


@torch.inference_mode()
def decode_step(model: EngineModel, cache: LazyCache, token: int, config: PruneConfig) -> torch.Tensor:
    """Append `token` at the next position and return the logits [vocab] for the one after it."""
    spec = model.spec
    num_prompt = cache.num_prompt
    config = config.for_prompt(num_prompt)
    new_position = cache.length
    reselects = config.enabled and config.reselects
    scorer = scorer_for(config)
    # Rows computed at the current layer: revived tokens (sorted) and the new token, always last.
    rows = torch.tensor([new_position], device=model.device)
    h = model.embed_tokens(rows.new_tensor([token]))  # [rows, hidden]
    live = None  # bool [new_position + 1] over positions; None: every token with KV here is live
    for index in range(spec.num_layers):
        q, k, v = project_qkv(model, index, h, rows)
        cache.write(index, rows, k, v)
        cache.revived_token_layers += rows.shape[0] - 1
        kv = cache.layers[index]
        key_live = None if live is None else live[kv.positions]  # [count]
        if index == spec.num_layers - 1:
            out = attend(model, q[:, :, -1:], kv.k, kv.v, mask=key_live)
            h = finish(model, index, h[-1:], out)
            break
        if rows.shape[0] == 1:
            out = attend(model, q, kv.k, kv.v, mask=key_live)
        else:
            # Revived rows attend causally, by original position, over the live keys.
            mask = kv.positions[None, :] <= rows[:, None]
            out = attend(model, q, kv.k, kv.v, mask=mask if key_live is None else mask & key_live[None])
        h = finish(model, index, h, out)
        keep = config.keep_at(index) if reselects else None
        if keep is None:
            continue
        candidates = kv.positions < num_prompt
        if key_live is not None:
            candidates &= key_live
        positions = kv.positions[candidates]
        attention = None
        if scorer.needs_attention:
            attention = _scores(model, cache, config, index, q[:, :, -1:], rows[-1:], kv, key_live)[candidates]
        scores = scorer.score(ScoreInputs(index, positions, attention))
        chosen = select(config, keep, scores, positions, num_prompt, mass=attention)
        live = torch.zeros(new_position + 1, dtype=torch.bool, device=model.device)
        live[num_prompt:] = True
        live[positions[chosen]] = True
        # Rows dropped here stop after this layer; kept tokens that stopped here earlier revive.
        staying = live[rows]
        cache.stash(index, rows[~staying], h[~staying])
        rows, h = rows[staying], h[staying]
        waiting = cache.aux[index].positions
        revived = waiting[live[waiting]] if waiting.shape[0] else waiting
        if revived.shape[0]:
            rows = torch.cat([revived, rows])
            h = torch.cat([cache.revive(index, revived), h])
            order = torch.argsort(rows)
            rows, h = rows[order], h[order]
    return logits_of(model, h[-1])


def _scores(model, cache: LazyCache, config: PruneConfig, index: int, q_new, position, kv, key_live) -> torch.Tensor:
    """Window attention over this layer's keys [count]; the new query [1, H, 1, D] joins the window."""
    if config.window == 1:
        return window_scores(model, q_new, kv.k, key_live)
    window = cache.windows.get(index)
    window = QueryWindow(position, q_new) if window is None else window.push(position, q_new, config.window)
    cache.windows[index] = window
    return window_scores(model, window.q, kv.k, key_live, window.positions, kv.positions)
