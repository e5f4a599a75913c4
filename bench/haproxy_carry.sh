#!/usr/bin/env bash
# Pack this machine's HAProxy with the libraries it links (all but glibc's own), to run
# bench/vs_haproxy.py on a machine that has no HAProxy package (a lent GPU machine, say):
#
#     bench/haproxy_carry.sh [DIR]          # DIR defaults to .hap (git-ignored)
#     PATH=$PWD/.hap/bin:$PATH python3 bench/vs_haproxy.py ...    # there
#
# The wrapper DIR/bin/haproxy sets LD_LIBRARY_PATH for HAProxy alone, so the bench's Python keeps
# its own libssl. The other machine's glibc must be at least this one's (`ldd --version`).
set -euo pipefail
dir="${1:-.hap}"
bin="$(command -v haproxy || true)"
if [ -z "$bin" ]; then
  echo "haproxy not found here: install it from your distribution (e.g. apt-get install haproxy)" >&2
  exit 2
fi
rm -rf "$dir"
mkdir -p "$dir/bin" "$dir/lib"
cp "$bin" "$dir/lib/haproxy.bin"
ldd "$bin" | awk '/=>/ { print $3 }' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.*|libm.so.*|ld-linux*) ;;  # glibc's: the other machine's own
    *) cp -L "$lib" "$dir/lib/" ;;
  esac
done
cat > "$dir/bin/haproxy" <<'EOF'
#!/bin/sh
d=$(dirname "$(readlink -f "$0")")/../lib
LD_LIBRARY_PATH=$d exec "$d/haproxy.bin" "$@"
EOF
chmod +x "$dir/bin/haproxy"
echo "$("$dir/bin/haproxy" -v | head -1)"
echo "packed into $dir: $(du -sh "$dir" | cut -f1), $(ls "$dir/lib" | wc -l) files; needs glibc >= $(ldd --version | head -1 | awk '{print $NF}')"
