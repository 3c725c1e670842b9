#!/usr/bin/env bash
# Build llama.cpp's benchmark programs from source, once, into batchjob's cache, for `batchjob bench
# --baselines ours,llama.cpp`; and convert a Hugging Face model folder to GGUF with llama.cpp's own converter.
#
#   bash examples/peers/llama_cpp.sh                      # build (minutes, once); prints the bin folder
#   bash examples/peers/llama_cpp.sh convert DIR f32|bf16 OUT.gguf
#
# The source is the llama.cpp vendored in the `llama-cpp-python` source distribution on PyPI (the only
# registry this project reaches); it is built with cmake, Release, -march=native (GGML_NATIVE), no network
# code (no curl/OpenSSL), only the targets the bench runs. `batchjob bench` finds the result in the cache
# folder below ($BATCHJOB_LLAMA_CPP overrides with a folder holding llama-batched-bench).
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${BATCHJOB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/batchjob}/peers/llama.cpp
SRC=$CACHE/llama-cpp-python-$VERSION/vendor/llama.cpp
BUILD=$CACHE/build-$VERSION
PY=${PYTHON:-python3}

fetch() {
  [ -f "$SRC/CMakeLists.txt" ] && return
  mkdir -p "$CACHE"
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
  tar xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
  mv "$CACHE/llama_cpp_python-$VERSION" "$CACHE/llama-cpp-python-$VERSION"
}

build() {
  fetch
  if [ ! -x "$BUILD/bin/llama-batched-bench" ] || [ ! -x "$BUILD/bin/llama-server" ]; then
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_BUILD_APP=OFF >&2
    cmake --build "$BUILD" --config Release -j "$(nproc)" --target llama-batched-bench llama-server >&2
  fi
  mkdir -p "$CACHE/bin"
  ln -sf "$BUILD/bin/llama-batched-bench" "$BUILD/bin/llama-server" "$CACHE/bin/"
  # llama-convert DIR f32|bf16 OUT.gguf: llama.cpp's converter with its own gguf-py (not the PyPI gguf that
  # batchjob loads with) and sentencepiece, which it imports for every Llama-family folder, installed beside it
  # rather than into the caller's environment (torch, numpy and transformers come from $PYTHON's).
  cat > "$CACHE/bin/llama-convert" <<WRAP
#!/usr/bin/env bash
set -euo pipefail
PY=\${PYTHON:-python3}
[ -d "$CACHE/convert-deps/sentencepiece" ] ||
  "\$PY" -m pip install -q --no-deps --target "$CACHE/convert-deps" "sentencepiece>=0.1.98,<0.3" >&2
export PYTHONPATH="$SRC/gguf-py:$CACHE/convert-deps\${PYTHONPATH:+:\$PYTHONPATH}"
exec "\$PY" "$SRC/convert_hf_to_gguf.py" "\$1" --outtype "\$2" --outfile "\$3"
WRAP
  chmod +x "$CACHE/bin/llama-convert"
  echo "$CACHE/bin"
}

case "${1:-build}" in
  build) build ;;
  convert) shift; build >/dev/null; PYTHON=$PY "$CACHE/bin/llama-convert" "$@" ;;
  *) echo "usage: $0 [build | convert DIR f32|bf16 OUT.gguf]" >&2; exit 2 ;;
esac
