"""`python -m shared.kernels [-v]`: build the native kernels (what `make setup` runs)."""

from shared.kernels.build import main

raise SystemExit(main())
