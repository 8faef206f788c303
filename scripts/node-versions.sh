#!/usr/bin/env bash
# The unit tests on other Node.js majors (default: 22 and 24; CI runs Node 20 itself). Each is the npm
# registry's node-<os>-<arch> package of that major, unpacked once under the cache folder; the tests run
# with this checkout's node_modules, as a user's install of the package on that Node would.
#   bash scripts/node-versions.sh [MAJOR ...]    cache: $MEGAMOE_NODE_CACHE or ~/.cache/megamoe/node
set -euo pipefail
cd "$(dirname "$0")/.."
majors=("$@")
[ ${#majors[@]} -gt 0 ] || majors=(22 24)
case "$(uname -m)" in
  x86_64) arch=x64 ;;
  aarch64 | arm64) arch=arm64 ;;
  *) echo "node-versions: no Node.js package for $(uname -m)" >&2; exit 2 ;;
esac
os=$(uname -s | tr '[:upper:]' '[:lower:]')
cache=${MEGAMOE_NODE_CACHE:-$HOME/.cache/megamoe/node}
mkdir -p "$cache"
tests=$(find test -name '*.test.ts' | sort)
for major in "${majors[@]}"; do
  dir="$cache/node-$os-$arch-$major"
  if [ ! -x "$dir/package/bin/node" ]; then
    tgz=$(cd "$cache" && npm pack --silent "node-$os-$arch@$major" | tail -1)
    rm -rf "$dir" && mkdir -p "$dir" && tar xzf "$cache/$tgz" -C "$dir" && rm -f "$cache/$tgz"
  fi
  node_bin="$dir/package/bin"
  echo "node-versions: unit tests on $("$node_bin/node" --version)"
  # The CLI tests start `node` from PATH or process.execPath: both are this version's.
  PATH="$node_bin:$PATH" node --import tsx --test --test-concurrency="$(node -p 'os.availableParallelism()')" \
    --test-reporter=dot $tests
done
