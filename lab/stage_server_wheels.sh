#!/usr/bin/env bash
# Stage the server's and the CLI's packages for the H200 (which has Python 3.12, numpy, jinja2,
# tokenizers, huggingface-hub and transformers, but no fastapi/pydantic/typer/textual and no network),
# so `python -m kapitsa serve` and `kapitsa bench` run there (lab/server_bench.py):
#
#   here:           bash lab/stage_server_wheels.sh            # writes the ignored folder .gpu/serve (~10 MB)
#   on the H200:    carry .gpu/serve (beside .gpu/mlx):  source .gpu/mlx/activate.sh && bash .gpu/serve/install.sh && ...
#
# The wheels install into /tmp/mlx-site, the folder .gpu/mlx/activate.sh already puts on PYTHONPATH.
set -euo pipefail
root="$(git rev-parse --show-toplevel)"
cd "$root"
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu/serve && mkdir -p .gpu/serve
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any --platform manylinux2014_x86_64)
for v in 35 34 31 28 27 24 17; do plat+=(--platform "manylinux_2_${v}_x86_64"); done
python3 -m pip download -q "${plat[@]}" -d .gpu/serve \
  "fastapi>=0.115" "uvicorn>=0.30" "uvloop>=0.19" "pydantic-settings>=2.4" "typer>=0.15" "rich>=13" "httpx>=0.27" \
  "llguidance>=1.9,<2" "gguf>=0.17" "keyring>=25" "textual==8.2.8"
# numpy (the H200 has it; 16 MB), and keyring's Secret Service
# backend (cryptography alone is 5 MB; without it keyring falls back, and a loopback server needs no key)
(cd .gpu/serve && rm -f numpy-* \
  cryptography-* cffi-* pycparser-* secretstorage-* SecretStorage-* jeepney-*)
cat > .gpu/serve/install.sh <<'EOS'
# run on the H200 after `source .gpu/mlx/activate.sh`
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlx-site "$(dirname "$0")"/*.whl \
  && python3 -c 'import fastapi, uvicorn, pydantic_settings, typer, llguidance; print("server packages ok")'
EOS
du -sh .gpu/serve
