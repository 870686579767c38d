#!/usr/bin/env bash
# moe-server end to end on loopback with the bundled tiny model: the official `openai` npm client
# (installed into .cache/ on first use) against moe-cli generate's greedy text, 64 concurrent
# streams, bad requests answered with OpenAI error bodies, a client that disconnects (mid-stream
# or while waiting for a non-streaming answer) giving its blocks back, a clean exit on SIGTERM,
# and the executor in a worker process driven over TCP (--serve-executor, --executor).
set -u
server=${MOE_SERVER:?path to moe-server}
cli=${MOE_CLI:?path to moe-cli}
src=${MOE_SOURCE_DIR:?repository root}
model="$src/models/tiny-qwen3-moe"
work=$(mktemp -d)
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; fi
  rm -rf "$work"
}
trap cleanup EXIT
failures=0
ok() { echo "ok   $1"; }
fail() { echo "FAIL $1"; failures=$((failures + 1)); }

client_dir="$src/.cache/openai-client"
if [ ! -d "$client_dir/node_modules/openai" ]; then
  mkdir -p "$client_dir"
  npm install --silent --no-audit --no-fund --prefix "$client_dir" openai@4 >/dev/null 2>&1 ||
    { echo "FAIL cannot install the openai npm client"; exit 1; }
fi

# Bad flags: exit status 1 and one "error:" line naming the problem, before anything listens.
bad_flags() {
  local name=$1 pattern=$2 err rc
  shift 2
  err=$("$server" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" = 1 ] && [ "$(printf '%s' "$err" | grep -c '')" = 1 ] && [[ "$err" == error:* ]] &&
      grep -qE -- "$pattern" <<<"$err"; then
    ok "$name: $err"
  else
    fail "$name: exit $rc, stderr $err"
  fi
}
bad_flags "--device tpu" 'valid devices are cpu and cuda' -m "$model" --device tpu
bad_flags "unknown flag" 'not expected: --bogus' -m "$model" --bogus
bad_flags "--random-weights on the CPU" 'needs --device cuda' -m "$model" --random-weights
bad_flags "--ep-backend p2p on the CPU" 'p2p' -m "$model" --ep 2 --ep-backend p2p
bad_flags "--ep-backend unknown" 'valid' -m "$model" --ep 2 --ep-backend nope
bad_flags "--ep-backend unknown with cuda" 'valid names' -m "$model" --device cuda --ep 2 --ep-backend nope
bad_flags "--ep beyond the experts" 'expert' -m "$model" --ep 4096
bad_flags "--tp without --ep" 'runs over the expert-parallel GPUs' -m "$model" --device cuda --tp 2
bad_flags "--dp through local_allreduce" 'use allgather_reducescatter' -m "$model" --device cuda --ep 2 --dp 2
bad_flags "--threads with cuda" "--threads sets CPU threads: it is for --device cpu" -m "$model" --device cuda --threads 2
bad_flags "--dp on the CPU" 'runs on GPUs only' -m "$model" --ep 2 --dp 2 --ep-backend alltoall_packed
if ! nvidia-smi -L >/dev/null 2>&1; then  # without a GPU (or CUDA build) --device cuda says why
  bad_flags "--device cuda without a GPU" 'CUDA' -m "$model" --device cuda
fi
bad_flags "missing model directory" 'does not exist' -m "$work/none"
bad_flags "--max-batch 0" 'max_batch' -m "$model" --max-batch 0
bad_flags "--port out of range" 'port' -m "$model" --port 70000
bad_flags "--executor and --serve-executor" 'not both' -m "$model" --executor 127.0.0.1:1 --serve-executor 127.0.0.1:0
bad_flags "--executor with a worker's flag" '--kv-blocks belongs to the worker' -m "$model" --executor 127.0.0.1:1 --kv-blocks 64
bad_flags "--executor without a port" 'expected HOST:PORT' -m "$model" --executor localhost
bad_flags "--executor with nobody listening" 'could not connect to 127.0.0.1:1 within 0.5 s' -m "$model" --executor 127.0.0.1:1 --executor-timeout 0.5

# start_server LOG ARGS...: starts moe-server with ARGS, its stderr in LOG; sets pid, and url once
# it listens (empty if it never did).
start_server() {
  local log=$1
  shift
  "$server" "$@" 2>"$log" &
  pid=$!
  url=""
  for _ in $(seq 1 300); do
    url=$(grep -oE 'http://127\.0\.0\.1:[0-9]+' "$log" | head -n 1)
    [ -n "$url" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
}
# Whether the last response body holds the one-rank greedy text (text0, written below) as a JSON string.
body_has_text0() {
  grep -qF "$(node -e 'process.stdout.write(JSON.stringify(require("fs").readFileSync(process.argv[1], "utf8")))' "$work/text0")" "$work/body"
}
start_server "$work/log" -m "$model" --port 0 -t 2 --max-batch 16
[ -n "$url" ] || { echo "FAIL the server did not start: $(cat "$work/log")"; exit 1; }

# request METHOD PATH [BODY]: prints the status code; the body lands in $work/body.
request() {
  if [ $# -ge 3 ]; then
    curl -s -o "$work/body" -w '%{http_code}' -X "$1" -H 'Content-Type: application/json' --data-binary "$3" "$url$2"
  else
    curl -s -o "$work/body" -w '%{http_code}' -X "$1" "$url$2"
  fi
}
# expect_error NAME STATUS PATTERN BODY [PATH]: an OpenAI-style error body with that status.
expect_error() {
  local status
  status=$(request POST "${5:-/v1/completions}" "$4")
  if [ "$status" = "$2" ] && grep -q '"error":{' "$work/body" && grep -qE -- "$3" "$work/body"; then
    ok "$1 -> $status $(cat "$work/body")"
  else
    fail "$1: status $status, body $(cat "$work/body")"
  fi
}

[ "$(request GET /health)" = 200 ] && grep -q '"ok"' "$work/body" && ok "health" || fail "health"

expect_error "malformed JSON" 400 'not valid JSON' '{"prompt": "a",'
expect_error "body not an object" 400 'JSON object' '[1, 2]'
expect_error "prompt of the wrong type" 400 '"param":"prompt"' '{"prompt": 5}'
expect_error "max_tokens of the wrong type" 400 '"param":"max_tokens"' '{"prompt": "a", "max_tokens": "5"}'
expect_error "stream of the wrong type" 400 '"param":"stream"' '{"prompt": "a", "stream": "yes"}'
expect_error "temperature out of range" 400 'temperature' '{"prompt": "a", "temperature": -1}'
expect_error "unknown model" 404 'model_not_found' '{"model": "gpt-4", "prompt": "a"}'
expect_error "max_tokens beyond the context" 400 'exceeds the context' '{"prompt": "a", "max_tokens": 5000}'
long=$(printf 'word %.0s' $(seq 1 5000))
expect_error "prompt longer than the context" 400 'context_length_exceeded' "{\"prompt\": \"$long\"}"
expect_error "chat without messages" 400 '"param":"messages"' '{"messages": []}' /v1/chat/completions
expect_error "chat message without content" 400 '"param":"messages"' '{"messages": [{"role": "user"}]}' /v1/chat/completions
[ "$(request GET /health)" = 200 ] && ok "still serving after bad requests" || fail "still serving after bad requests"

# The greedy text moe-cli generate prints for each case alone.
cases=("0|8|Hello there" "0|16|The capital of France is" "0|5|1, 2, 3," "0|24|Once upon a time"
       "1|6|Hi" "1|12|Tell me a story" "1|20|What is 2 + 2?" "0|1|a")
for i in "${!cases[@]}"; do
  IFS='|' read -r chat n prompt <<<"${cases[$i]}"
  flags=()
  [ "$chat" = 1 ] && flags=(--chat)
  out=$("$cli" generate -m "$model" -p "$prompt" -n "$n" --temp 0 "${flags[@]}" 2>/dev/null; printf x)
  out=${out%x}
  printf '%s' "${out%$'\n'}" >"$work/text$i"
  printf '%s\n%s\n%s\n' "$chat" "$n" "$prompt" >"$work/case$i"
done
MOE_WORK="$work" MOE_COUNT=${#cases[@]} node -e '
  const fs = require("fs"), w = process.env.MOE_WORK, out = [];
  for (let i = 0; i < +process.env.MOE_COUNT; i++) {
    const [chat, n, prompt] = fs.readFileSync(`${w}/case${i}`, "utf8").split("\n");
    out.push({ chat: chat === "1", n: +n, prompt, text: fs.readFileSync(`${w}/text${i}`, "utf8") });
  }
  fs.writeFileSync(`${w}/expect.json`, JSON.stringify(out));'
if NODE_PATH="$client_dir/node_modules" MOE_URL="$url" MOE_MODEL=tiny-qwen3-moe MOE_EXPECT="$work/expect.json" \
    node "$src/tests/cli/server_client.cjs"; then
  ok "openai client"
else
  fail "openai client"
fi

# metric NAME: its value from /metrics.
metric() { curl -s "$url/metrics" | awk -v n="$1" '$1 == n { print $2 }'; }
[ "$(metric moe_kv_blocks_in_use)" = 0 ] && ok "no KV blocks in use after the clients" ||
  fail "KV blocks in use after the clients: $(metric moe_kv_blocks_in_use)"
# blocks_freed: whether, within about three seconds, no KV block is in use and no request runs.
blocks_freed() {
  for _ in $(seq 1 30); do
    [ "$(metric moe_kv_blocks_in_use)" = 0 ] && [ "$(metric moe_running_requests)" = 0 ] && return 0
    sleep 0.1
  done
  return 1
}

# A client that leaves mid-stream: its request is cancelled and its blocks come back long
# before the 4000 tokens it asked for would have been generated (an idle fast core writes them
# in under two seconds, so the client leaves after half of one; the first chunks come in
# milliseconds).
curl -sN --max-time 0.5 -H 'Content-Type: application/json' \
  --data-binary '{"prompt": "Hello", "max_tokens": 4000, "temperature": 0, "stream": true}' \
  "$url/v1/completions" >"$work/partial"
freed=0
blocks_freed && freed=1
if grep -q '^data: {' "$work/partial" && ! grep -q 'DONE' "$work/partial" && [ "$freed" = 1 ]; then
  ok "a disconnected stream frees its blocks"
else
  fail "disconnect: $(grep -c '^data:' "$work/partial") chunks, blocks in use $(metric moe_kv_blocks_in_use)"
fi
# The same for a client that gives up on a non-streaming request before its answer exists. The
# tiny model writes 4000 tokens in about two seconds on a fast core, so the client leaves well
# before that.
curl -s --max-time 0.5 -H 'Content-Type: application/json' \
  --data-binary '{"prompt": "Hello", "max_tokens": 4000, "temperature": 0}' \
  "$url/v1/completions" >"$work/partial_plain"
freed=0
blocks_freed && freed=1
if [ ! -s "$work/partial_plain" ] && [ "$freed" = 1 ]; then
  ok "a client that leaves a non-streaming request frees its blocks"
else
  fail "non-streaming disconnect: body $(head -c 80 "$work/partial_plain"), blocks in use $(metric moe_kv_blocks_in_use)"
fi
[ "$(request POST /v1/completions '{"prompt": "Hello there", "max_tokens": 8, "temperature": 0}')" = 200 ] &&
  body_has_text0 &&
  ok "still serving after a disconnect" || fail "still serving after a disconnect: $(cat "$work/body")"

# SIGTERM with a request in flight: the server ends it and exits with status 0.
curl -sN -H 'Content-Type: application/json' \
  --data-binary '{"prompt": "Hello", "max_tokens": 3000, "temperature": 0, "stream": true}' \
  "$url/v1/completions" >"$work/inflight" &
curl_pid=$!
sleep 0.5
kill -TERM "$pid"
for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$pid" 2>/dev/null; then
  fail "SIGTERM: the server is still running after 10 s"
else
  wait "$pid"
  rc=$?
  pid=""
  [ "$rc" = 0 ] && ok "SIGTERM: clean exit" || fail "SIGTERM: exit status $rc"
fi
wait "$curl_pid" 2>/dev/null

# Two expert-parallel ranks on the CPU serve the greedy text of one.
for backend in local_allreduce alltoall_packed; do
  start_server "$work/log_ep" -m "$model" --port 0 -t 2 --ep 2 --ep-backend "$backend"
  if [ -n "$url" ] && [ "$(request POST /v1/completions '{"prompt": "Hello there", "max_tokens": 8, "temperature": 0}')" = 200 ] &&
      body_has_text0; then
    ok "--ep 2 --ep-backend $backend on the CPU gives the one-rank text"
  else
    fail "--ep 2 --ep-backend $backend: $(cat "$work/body" 2>/dev/null) $(tail -n 3 "$work/log_ep")"
  fi
  kill -TERM "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  pid=""
done

# The executor in another process: a worker holds the model and a server drives it over TCP,
# serving the one-process greedy text. A driver of another model is refused in one line, and so
# is a second driver while one is served; when a driver goes, the worker waits for the next (two
# servers in turn give the same text); SIGTERM ends it cleanly.
# start_worker LOG: starts an executor worker on the tiny model; sets worker and worker_port.
start_worker() {
  "$server" -m "$model" -t 2 --max-batch 16 --serve-executor 127.0.0.1:0 2>"$1" &
  worker=$!
  worker_port=""
  for _ in $(seq 1 300); do
    worker_port=$(grep -oE 'listening on 127\.0\.0\.1:[0-9]+' "$1" | grep -oE '[0-9]+$')
    [ -n "$worker_port" ] && break
    kill -0 "$worker" 2>/dev/null || break
    sleep 0.1
  done
}
# wait_drivers_gone N: until the worker has logged N drivers gone (at most 10 s).
wait_drivers_gone() {
  for _ in $(seq 1 100); do
    [ "$(grep -cE 'the driver disconnected|connection ended' "$work/log_worker")" -ge "$1" ] && return 0
    sleep 0.1
  done
  return 1
}
start_worker "$work/log_worker"
if [ -z "$worker_port" ]; then
  fail "executor worker did not start: $(cat "$work/log_worker")"
else
  err=$("$server" -m "$src/tests/fixtures/olmoe_f32" --tokenizer "$model/tokenizer.json" --port 0 \
    --executor "127.0.0.1:$worker_port" 2>&1 >/dev/null)
  rc=$?
  [ "$rc" = 1 ] && [[ "$err" == error:*"not the same model"* ]] && ok "--executor over another model's worker: $err" ||
    fail "--executor over another model's worker: exit $rc, $err"
  wait_drivers_gone 1 || fail "the worker did not log the refused driver's departure: $(tail -n 2 "$work/log_worker")"
  for round in 1 2; do
    start_server "$work/log_driver" -m "$model" --port 0 --executor "127.0.0.1:$worker_port"
    if [ -n "$url" ] && [ "$(request POST /v1/completions '{"prompt": "Hello there", "max_tokens": 8, "temperature": 0}')" = 200 ] &&
        body_has_text0; then
      ok "server $round of 2 driving the executor worker over TCP gives the one-process text"
    else
      fail "--executor, server $round: $(cat "$work/body" 2>/dev/null) $(tail -n 3 "$work/log_driver") $(tail -n 3 "$work/log_worker")"
    fi
    if [ "$round" = 1 ]; then
      err=$("$server" -m "$model" --port 0 --executor "127.0.0.1:$worker_port" 2>&1 >/dev/null)
      rc=$?
      [ "$rc" = 1 ] && [[ "$err" == error:*"busy with another driver"* ]] &&
        ok "a second driver while one is served: $err" || fail "a second driver while one is served: exit $rc, $err"
    fi
    kill -TERM "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    pid=""
    wait_drivers_gone $((round + 1)) || fail "the worker did not see server $round go: $(tail -n 2 "$work/log_worker")"
  done
  kill -0 "$worker" 2>/dev/null && ok "the executor worker outlives its drivers" ||
    fail "the executor worker exited with its drivers: $(tail -n 2 "$work/log_worker")"
  kill -TERM "$worker" 2>/dev/null
  for _ in $(seq 1 100); do kill -0 "$worker" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$worker" 2>/dev/null; then
    fail "the executor worker still runs 10 s after SIGTERM"
    kill -KILL "$worker"
  else
    wait "$worker"
    rc=$?
    [ "$rc" = 0 ] && grep -q 'served 3 driver(s) and exits' "$work/log_worker" &&
      ok "the executor worker exits cleanly on SIGTERM" ||
      fail "executor worker: exit status $rc, $(tail -n 2 "$work/log_worker")"
  fi
fi

echo "$failures failure(s)"
[ "$failures" -eq 0 ]
