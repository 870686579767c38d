#!/usr/bin/env bash
# moe-server --device cuda on two GPUs with every EP backend, and with data-parallel attention
# (--dp 2) over every backend that exchanges each GPU's own tokens (once more with a step budget
# of 4 tokens, so that the prompt is prefilled in chunks), on the bundled tiny model: each must
# serve a streamed greedy completion (chunks, then [DONE]) whose text equals the one-GPU server's.
# With four GPUs or more, also two attention groups of two GPUs (--dp 2 --tp 2 --ep 4) over the
# same backends.
# Last, the two-GPU data-parallel executor in a worker process (--serve-executor) driven by two
# servers in turn over TCP (--executor), then stopped with SIGTERM. Prints one line per case;
# exit status 0 only when every one passed.
#
#   scripts/serve_ep_check.sh [BIN_DIR]      BIN_DIR holds moe-server (default build/release)
set -u
cd "$(dirname "$0")/.."
bin=${1:-build/release}
server=$bin/moe-server
[ -x "$server" ] || server=$bin/tools/moe-server
model=models/tiny-qwen3-moe
work=$(mktemp -d)
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; fi
  rm -rf "$work"
}
trap cleanup EXIT
export NCCL_NVLS_ENABLE=0

# stream URL: the text of a streamed greedy completion, or exit status 1 with the reason.
stream() {
  python3 - "$1" <<'PY'
import json, sys, urllib.request
body = json.dumps({"prompt": "Hello there, tell me", "max_tokens": 24, "temperature": 0, "stream": True}).encode()
req = urllib.request.Request(sys.argv[1] + "/v1/completions", body, {"Content-Type": "application/json"})
text, done, chunks = "", False, 0
with urllib.request.urlopen(req, timeout=120) as r:
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            sys.exit("error event: " + data)
        text += event["choices"][0].get("text", "")
        chunks += 1
if not done or chunks < 2:
    sys.exit(f"stream ended without [DONE] or with {chunks} chunks")
print(text)
PY
}

# serve NAME ARGS...: starts the server, streams one completion into $work/NAME, stops it.
serve() {
  local name=$1 url=""
  shift
  "$server" -m "$model" --port 0 "$@" 2> "$work/$name.log" &
  pid=$!
  for _ in $(seq 1 600); do
    url=$(grep -oE 'http://127\.0\.0\.1:[0-9]+' "$work/$name.log" | head -n 1)
    [ -n "$url" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  local rc=1
  if [ -n "$url" ]; then
    stream "$url" > "$work/$name" 2> "$work/$name.err"
    rc=$?
  fi
  kill -TERM "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  pid=""
  [ $rc -eq 0 ] || { echo "$name: $(cat "$work/$name.err" 2>/dev/null) $(tail -n 2 "$work/$name.log")"; return 1; }
}

failures=0
serve one_gpu --device cuda || { echo "FAIL the one-GPU server: no completion"; exit 1; }
echo "one GPU: $(tr '\n' ' ' < "$work/one_gpu")"
# Every backend with replicated attention, then data-parallel attention (--dp 2: each GPU serves
# its own requests with its own cache) over every backend that exchanges each GPU's own tokens.
runs=(local_allreduce allgather_reducescatter alltoall_padded alltoall_packed p2p
      dp:allgather_reducescatter dp:alltoall_padded dp:alltoall_packed dp:p2p dp4:alltoall_packed)
if [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 4 ]; then
  runs+=(groups:allgather_reducescatter groups:alltoall_padded groups:alltoall_packed groups:p2p groups4:p2p)
fi
for run in "${runs[@]}"; do
  backend=${run#*:}
  kind=${run%%:*}
  flags=(--device cuda --ep 2 --ep-backend "$backend")
  case $kind in
    dp | dp4) flags+=(--dp 2) ;;
    groups | groups4) flags=(--device cuda --ep 4 --dp 2 --tp 2 --ep-backend "$backend") ;;
  esac
  case $kind in dp4 | groups4) flags+=(--max-batch 4 --max-step-tokens 4) ;; esac
  name=${run/:/_}
  if ! serve "$name" "${flags[@]}"; then
    echo "FAIL ${flags[*]}: no streamed completion"
    failures=$((failures + 1))
  elif cmp -s "$work/one_gpu" "$work/$name"; then
    echo "ok   ${flags[*]} streams the one-GPU text"
  else
    echo "FAIL ${flags[*]} streams: $(tr '\n' ' ' < "$work/$name")"
    failures=$((failures + 1))
  fi
done

# The data-parallel executor in a worker process, a server driving it over TCP.
"$server" -m "$model" --device cuda --ep 2 --dp 2 --ep-backend alltoall_packed --serve-executor 127.0.0.1:0 \
  2> "$work/worker.log" &
worker=$!
port=""
for _ in $(seq 1 600); do
  port=$(grep -oE 'listening on 127\.0\.0\.1:[0-9]+' "$work/worker.log" | grep -oE '[0-9]+$')
  [ -n "$port" ] && break
  kill -0 "$worker" 2>/dev/null || break
  sleep 0.1
done
# driver_gone: until the worker has logged its driver's departure (a driver that came sooner
# would find it busy).
driver_gone() {
  for _ in $(seq 1 100); do grep -q 'the driver disconnected' "$work/worker.log" && return 0; sleep 0.1; done
  return 1
}
if [ -n "$port" ] && serve worker_dp --executor "127.0.0.1:$port" && cmp -s "$work/one_gpu" "$work/worker_dp" &&
    driver_gone && serve worker_dp_again --executor "127.0.0.1:$port" && cmp -s "$work/one_gpu" "$work/worker_dp_again" &&
    kill -TERM "$worker" && wait "$worker"; then
  echo "ok   two servers in turn driving a --dp 2 worker over TCP stream the one-GPU text, and the worker exits cleanly on SIGTERM"
else
  echo "FAIL --dp 2 worker: $(tr '\n' ' ' < "$work/worker_dp" 2>/dev/null) $(tail -n 2 "$work/worker.log")"
  kill "$worker" 2>/dev/null
  failures=$((failures + 1))
fi
echo "$failures failure(s)"
[ "$failures" -eq 0 ]
