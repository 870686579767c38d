#!/usr/bin/env python3
"""Hostile inputs against the built binaries, as an attacker would send them: damaged model
directories, tokenizers and chat templates through moe-cli, and abusive HTTP clients against
moe-server. Every case must end in bounded time, within an address-space limit (RLIMIT_AS), never
by a signal, with one clear error; the server must keep answering /health throughout and stay up.

Prints a Markdown table (case, result, seconds, peak resident memory) and exits non-zero when any
case fails. Environment: MOE_CLI, MOE_SERVER, MOE_SOURCE_DIR; MOE_HOSTILE_TABLE=FILE also writes
the table there; MOE_SANITIZED=1 for AddressSanitizer builds (see MEMORY_LIMIT).
"""
import gzip
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

CLI = os.environ["MOE_CLI"]
SERVER = os.environ["MOE_SERVER"]
SRC = os.environ["MOE_SOURCE_DIR"]
TINY = os.path.join(SRC, "models", "tiny-qwen3-moe")
FIXTURE = os.path.join(SRC, "tests", "fixtures", "qwen3_moe_f32")
MEMORY_LIMIT = 4 << 30  # bytes of address space for every process under test
# AddressSanitizer reserves terabytes of address space for its shadow, so under it the bound is
# its own resident-memory limit instead of RLIMIT_AS.
SANITIZED = os.environ.get("MOE_SANITIZED") == "1"
if SANITIZED:
    os.environ["ASAN_OPTIONS"] = ":".join(filter(None, [os.environ.get("ASAN_OPTIONS"),
                                                        f"hard_rss_limit_mb={MEMORY_LIMIT >> 20}"]))
CASE_SECONDS = 20       # a case that runs longer has failed (hung)

rows = []
failures = 0


def record(case, ok, result, seconds, peak_mb):
    global failures
    rows.append((case, "ok" if ok else "FAIL", result, seconds, peak_mb))
    failures += 0 if ok else 1
    print(f"{'ok  ' if ok else 'FAIL'} {case}: {result} ({seconds:.2f} s, {peak_mb:.0f} MB)", flush=True)


def limit_memory():
    if not SANITIZED:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run(args, timeout=CASE_SECONDS):
    """Runs a command under the memory limit: (exit status or -signal, stderr, seconds, peak MB);
    status None when it had to be killed."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=limit_memory)
        while True:  # wait4 reports this child's own peak resident memory
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > timeout:
                proc.kill()
                os.wait4(proc.pid, 0)
                proc.returncode = -9
                return None, "timed out", time.monotonic() - start, 0.0
            time.sleep(0.01)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - start
        err.seek(0)
        return proc.returncode, err.read().decode("utf-8", "replace"), seconds, usage.ru_maxrss / 1024


def expect_cli(case, pattern, args):
    rc, err, seconds, peak = run(args)
    lines = [l for l in err.splitlines() if l.strip()]
    ok = (rc is not None and 0 < rc < 128 and len(lines) == 1 and lines[0].startswith("error:")
          and re.search(pattern, lines[0]) is not None)
    what = lines[0] if lines else f"exit {rc}, no message"
    if rc is None:
        what = "hung (killed)"
    elif rc < 0:
        what = f"killed by signal {-rc}"
    record(case, ok, what[:160], seconds, peak)


def fresh(work, src=FIXTURE):
    d = os.path.join(work, "m")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d, symlinks=True)
    return d


def edit_json(path, fn):
    with open(path) as f:
        j = json.load(f)
    fn(j)
    with open(path, "w") as f:
        json.dump(j, f)


def model_cases(work):
    def config_case(case, pattern, fn, command=("info",)):
        d = fresh(work)
        edit_json(os.path.join(d, "config.json"), fn)
        expect_cli(case, pattern, [CLI, *command, "-m", d])

    config_case("config: num_hidden_layers 1e9 (integer)", "num_hidden_layers",
                lambda c: c.update(num_hidden_layers=1000000000))
    config_case("config: vocab_size 2^40", "vocab_size", lambda c: c.update(vocab_size=1 << 40))
    config_case("config: 100k experts", "experts", lambda c: c.update(num_experts=100000))
    config_case("config: hidden_size 2^40", "hidden_size", lambda c: c.update(hidden_size=1 << 40))
    config_case("config: eos_token_id a string", "eos_token_id", lambda c: c.update(eos_token_id="</s>"))
    config_case("config: quantization_config fp8", "quantization_config",
                lambda c: c.update(quantization_config={"quant_method": "fp8"}))
    config_case("config: dynamic rope", "dynamic",
                lambda c: c["rope_parameters"].update(rope_type="dynamic", factor=2.0))
    config_case("config: rope_theta 0", "rope_theta", lambda c: c["rope_parameters"].update(rope_theta=0))

    d = fresh(work)
    os.remove(os.path.join(d, "model.safetensors"))
    os.mkfifo(os.path.join(d, "model.safetensors"))
    expect_cli("weights: a FIFO in place of model.safetensors", "FIFO|regular", [CLI, "logits", "-m", d, "--ids", "1"])
    d = fresh(work)
    os.remove(os.path.join(d, "config.json"))
    os.mkdir(os.path.join(d, "config.json"))
    expect_cli("config: a directory in place of config.json", "regular|directory", [CLI, "info", "-m", d])
    d = fresh(work)
    with open(os.path.join(d, "model.safetensors"), "r+b") as f:
        f.truncate(100000)
    expect_cli("weights: truncated", "past the end|truncated", [CLI, "logits", "-m", d, "--ids", "1"])
    d = fresh(work)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write((1 << 40).to_bytes(8, "little") + b"{}")
    expect_cli("weights: header claims 1 TB", "header|larger", [CLI, "logits", "-m", d, "--ids", "1"])

    # Tokenizers (moe-cli tokenize) and chat templates (moe-cli generate --chat).
    t = fresh(work, TINY)
    tok_path = os.path.join(t, "tokenizer.json")
    with open(tok_path) as f:
        tok = json.load(f)
    tok["added_tokens"].append({"id": 300000000, "content": "<huge>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    with open(tok_path, "w") as f:
        json.dump(tok, f)
    expect_cli("tokenizer: an id near 3e8", "300000000", [CLI, "tokenize", "-m", t, "--text", "hi"])
    t = fresh(work, TINY)
    os.remove(os.path.join(t, "tokenizer.json"))
    os.mkfifo(os.path.join(t, "tokenizer.json"))
    expect_cli("tokenizer: a FIFO in place of tokenizer.json", "FIFO|regular", [CLI, "tokenize", "-m", t, "--text", "hi"])

    templates = [
        ("template: 3,000 nested parentheses", "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "nest|depth"),
        ("template: 3,000 nested ifs", "{% if true %}" * 3000 + "x" + "{% endif %}" * 3000, "nest|depth"),
        ("template: INT64_MIN // -1", "{{ (-9223372036854775807 - 1) // -1 }}", "overflow|range"),
        ("template: 2 ** 10**15", "{{ 2 ** 10 ** 15 }}", "overflow|limit|range"),
        ("template: a million-by-million loop", "{% for i in range(1000000) %}{% for j in range(1000000) %}"
                                                "{% endfor %}{% endfor %}", "step|limit"),
        ("template: a 5,000-by-5,000 loop", "{% for i in range(5000) %}{% for j in range(5000) %}"
                                            "{% endfor %}{% endfor %}", "step limit"),
        ("template: 'a' * 10**10", "{{ 'a' * 10000000000 }}", "size|limit|long"),
        ("template: list doubling", "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}"
                                    "{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}", "size|limit|long"),
    ]
    for case, source, pattern in templates:
        t = fresh(work, TINY)
        edit_json(os.path.join(t, "tokenizer_config.json"), lambda c: c.update(chat_template=source))
        expect_cli(case, pattern, [CLI, "generate", "-m", t, "-p", "hi", "-n", "1", "--chat"])


# ---- the server ---------------------------------------------------------------------------------

class Server:
    def __init__(self, model, *flags):
        self.log = tempfile.NamedTemporaryFile(prefix="moe-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([SERVER, "-m", model, "--port", "0", "-t", "2", *flags], stdout=subprocess.DEVNULL,
                                     stderr=self.log, preexec_fn=limit_memory)
        self.port = None
        for _ in range(300):
            with open(self.log.name) as f:
                m = re.search(r"http://127\.0\.0\.1:(\d+)", f.read())
            if m:
                self.port = int(m.group(1))
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        if self.port is None:
            raise SystemExit(f"the server did not start: {open(self.log.name).read()}")

    def peak_mb(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024
        except (OSError, AttributeError):
            return 0.0

    def alive(self):
        return self.proc.poll() is None

    def request(self, raw, timeout=10):
        """Sends raw bytes on a fresh connection; returns (status, body) of the answer."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            try:
                s.sendall(raw)
            except (BrokenPipeError, ConnectionResetError):
                pass  # answered and closed before the whole request was sent
            return read_response(s)

    def post(self, path, body, headers=None):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
        for k, v in (headers or {}).items():
            head += f"{k}: {v}\r\n"
        head += f"Content-Length: {len(data)}\r\n\r\n"
        return self.request(head.encode() + data)

    def health(self, timeout=2):
        try:
            status, body = self.request(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout)
            return status == 200 and b'"ok"' in body
        except OSError:
            return False

    def stop(self):
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


def read_response(s):
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        data += chunk
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            m = re.search(rb"Content-Length: (\d+)", head, re.I)
            if m and len(rest) >= int(m.group(1)):
                break
    m = re.match(rb"HTTP/1\.1 (\d+)", data)
    return (int(m.group(1)) if m else 0), data.partition(b"\r\n\r\n")[2]


def server_case(srv, case, fn):
    """fn() -> (ok, result). Also checks that /health answers afterwards and the server lives."""
    start = time.monotonic()
    try:
        ok, result = fn()
    except Exception as e:  # noqa: BLE001 - a client-side failure is a failed case
        ok, result = False, f"client error: {e!r}"
    seconds = time.monotonic() - start
    if not srv.alive():
        ok, result = False, f"the server died (exit {srv.proc.returncode}); {result}"
    elif not srv.health():
        ok, result = False, f"/health did not answer afterwards; {result}"
    record(case, ok, result, seconds, srv.peak_mb())


def error_of(body):
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:120].decode("utf-8", "replace")


def expect_status(srv, want, path, body, headers=None, says=""):
    status, answer = srv.post(path, body, headers)
    message = error_of(answer)
    return status == want and re.search(says, message) is not None, f"{status}: {message[:140]}"


def brotli_bomb(size):
    """A brotli body of `size` zero bytes, from the brotli command-line tool."""
    try:
        return subprocess.run(["brotli", "-c", "-q", "11"], input=b"\0" * size, capture_output=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def slow_clients(srv, count, seconds_between=0.5):
    """Opens `count` connections that send their request a byte at a time; returns them."""
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.settimeout(60)
        socks.append(s)
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 200 + b"\r\n\r\n"

    def drip():
        for i in range(len(request)):
            for s in socks:
                try:
                    s.send(request[i:i + 1])
                except OSError:
                    pass
            time.sleep(seconds_between)
    threading.Thread(target=drip, daemon=True).start()
    return socks


def server_cases(work):
    srv = Server(TINY, "--request-timeout", "3", "--max-connections", "64", "--max-body-bytes", str(8 << 20))
    try:
        bomb = brotli_bomb(1 << 30)
        if bomb is not None:
            server_case(srv, f"HTTP: {len(bomb) / 1024:.1f} KB brotli body inflating to 1 GiB",
                        lambda: expect_status(srv, 413, "/v1/completions", bomb, {"Content-Encoding": "br"},
                                              "decoded request body exceeds"))
        else:
            record("HTTP: brotli bomb", False, "the brotli tool is missing (scripts/install_deps.sh installs it)", 0, 0)
        gz = gzip.compress(b"\0" * (1 << 30), 9)
        server_case(srv, f"HTTP: {len(gz) / 1024:.0f} KB gzip body inflating to 1 GiB",
                    lambda: expect_status(srv, 413, "/v1/completions", gz, {"Content-Encoding": "gzip"},
                                          "decoded request body exceeds"))

        def big_body():
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 536870912\r\n\r\n")
                status, body = read_response(s)  # answered before a byte of the body is sent
            return status == 413, f"{status}: {error_of(body)}"
        server_case(srv, "HTTP: a 512 MB body announced", big_body)
        server_case(srv, "HTTP: a 7 MB one-word prompt",
                    lambda: expect_status(srv, 400, "/v1/completions", {"prompt": "a" * (7 << 20)}, None,
                                          "prompt is too long"))
        server_case(srv, "HTTP: 100 KB of headers",
                    lambda: (lambda r: (r[0] == 431, f"{r[0]}: {error_of(r[1])}"))(
                        srv.request(b"GET /health HTTP/1.1\r\nX-Big: " + b"b" * 100000 + b"\r\n\r\n")))
        server_case(srv, "HTTP: 500 header fields",
                    lambda: (lambda r: (r[0] == 431, f"{r[0]}: {error_of(r[1])}"))(
                        srv.request(b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(500))
                                    + b"\r\n")))
        server_case(srv, "HTTP: JSON nested a million deep",
                    lambda: expect_status(srv, 400, "/v1/completions", b"[" * 1000000, None, "nests deeper"))
        for field, value in [("n", 2), ("logprobs", 5), ("tools", [{"type": "function"}]),
                             ("response_format", {"type": "json_object"}), ("best_of", 3), ("frobnicate", 1)]:
            path = "/v1/chat/completions" if field in ("tools", "response_format") else "/v1/completions"
            body = {"messages": [{"role": "user", "content": "hi"}]} if path.endswith("chat/completions") else {
                "prompt": "hi"}
            body[field] = value
            server_case(srv, f"HTTP: unimplemented field '{field}'",
                        lambda b=body, p=path, f=field: expect_status(srv, 400, p, b, None, f"'{f}'"))
        server_case(srv, "HTTP: temperature 1e-45 (denormal)",
                    lambda: expect_status(srv, 200, "/v1/completions",
                                          {"prompt": "hi", "max_tokens": 2, "temperature": 1e-45}))
        server_case(srv, "HTTP: top_k 2^40",
                    lambda: expect_status(srv, 200, "/v1/completions",
                                          {"prompt": "hi", "max_tokens": 2, "top_k": 1 << 40}))
        server_case(srv, "HTTP: unknown path",
                    lambda: (lambda r: (r[0] == 404 and "no such endpoint" in error_of(r[1]), f"{r[0]}: {error_of(r[1])}"))(
                        srv.request(b"GET /admin HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")))
        server_case(srv, "HTTP: GET on a POST endpoint",
                    lambda: (lambda r: (r[0] == 405 and "takes POST" in error_of(r[1]), f"{r[0]}: {error_of(r[1])}"))(
                        srv.request(b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")))

        def slowloris():
            socks = slow_clients(srv, 40)
            answered = 0
            for _ in range(5):  # /health throughout the 3 s the slow requests may take
                answered += srv.health(timeout=1)
                time.sleep(0.5)
            timeouts = 0
            for s in socks:
                status, _ = read_response(s)
                timeouts += status == 408
                s.close()
            return answered == 5 and timeouts == 40, f"/health answered {answered}/5 meanwhile; {timeouts}/40 got 408"
        server_case(srv, "HTTP: 40 clients sending headers a byte at a time", slowloris)

        def flood():
            socks = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(80)]
            time.sleep(0.5)
            refused = 0
            for s in socks[64:]:
                s.settimeout(5)
                try:
                    status, _ = read_response(s)
                    refused += status == 503
                except OSError:
                    pass
            for s in socks:
                s.close()
            time.sleep(0.3)
            return refused >= 16 - 1, f"{refused} of the 16 past the 64-connection cap answered 503"
        server_case(srv, "HTTP: 80 idle connections against a cap of 64", flood)

        def shutdown_with_slow_clients():
            socks = slow_clients(srv, 20, seconds_between=1.0)
            time.sleep(0.5)
            start = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            try:
                rc = srv.proc.wait(10)
            except subprocess.TimeoutExpired:
                return False, "still running 10 s after SIGTERM"
            took = time.monotonic() - start
            for s in socks:
                s.close()
            return rc == 0 and took < 2.5, f"exit {rc} {took:.2f} s after SIGTERM with 20 slow clients"
        start = time.monotonic()
        ok, result = shutdown_with_slow_clients()
        record("HTTP: SIGTERM while slow clients hold connections", ok, result, time.monotonic() - start, 0.0)
    finally:
        srv.stop()

    # A template that fails at load leaves the server up without chat.
    t = fresh(work, TINY)
    edit_json(os.path.join(t, "tokenizer_config.json"), lambda c: c.update(chat_template="{% for %}"))
    srv = Server(t)
    try:
        server_case(srv, "HTTP: chat with a template that does not parse",
                    lambda: expect_status(srv, 400, "/v1/chat/completions",
                                          {"messages": [{"role": "user", "content": "hi"}]}, None, "chat is not available"))
        server_case(srv, "HTTP: completions beside that template",
                    lambda: expect_status(srv, 200, "/v1/completions", {"prompt": "hi", "max_tokens": 2}))
    finally:
        srv.stop()
    # A template that runs away at render time fails its request only.
    t = fresh(work, TINY)
    edit_json(os.path.join(t, "tokenizer_config.json"),
              lambda c: c.update(chat_template="{% for i in range(5000) %}{% for j in range(5000) %}"
                                               "{% endfor %}{% endfor %}"))
    srv = Server(t)
    try:
        server_case(srv, "HTTP: chat with a template that never ends",
                    lambda: expect_status(srv, 400, "/v1/chat/completions",
                                          {"messages": [{"role": "user", "content": "hi"}]}, None, "step limit"))
    finally:
        srv.stop()


def main():
    work = tempfile.mkdtemp(prefix="moe-hostile-")
    try:
        model_cases(work)
        server_cases(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = ["| case | verdict | result | seconds | peak RSS (MB) |", "|---|---|---|---:|---:|"]
    for case, verdict, result, seconds, peak in rows:
        result = result.replace("|", "\\|")
        table.append(f"| {case} | {verdict} | {result} | {seconds:.2f} | {peak:.0f} |")
    text = "\n".join(table) + "\n"
    print(text)
    if os.environ.get("MOE_HOSTILE_TABLE"):
        with open(os.environ["MOE_HOSTILE_TABLE"], "w") as f:
            f.write(text)
    print(f"{failures} failure(s) of {len(rows)} cases")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
