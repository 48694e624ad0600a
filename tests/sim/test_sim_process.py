"""The command line: ``python -m narwhal_sim`` / ``narwhal_sim.cli.main``, and SimProcess kill/restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from narwhal_sim.cli import build_parser, config_from_args, main
from narwhal_sim.server import SimConfig
from narwhal_sim.testing import SimProcess

from ..helpers import busy_port
from .helpers import PROMPT, prefill_body, run_prefill


def test_startup_line_and_graceful_stop() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal_sim", "--role", "prefill", "--listen", "127.0.0.1:0", "--log", "none"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        event = json.loads(line)
        assert event["event"] == "listening" and event["role"] == "prefill" and event["host"] == "127.0.0.1"
        assert isinstance(event["port"], int) and event["port"] > 0
        assert event["url"] == f"http://127.0.0.1:{event['port']}"
        assert httpx.get(event["url"] + "/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0
        assert out == b"" and b"Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kill_and_restart_on_the_same_port(client: httpx.Client) -> None:
    with SimProcess("prefill", speed=50) as p, SimProcess("decode", speed=50, kv_pull_timeout_s=2) as d:
        port, first_id = p.port, p.engine_id
        kv = run_prefill(client, p.url, "crash-p1")
        assert p.stats()["kv_held"] == 1
        p.kill()
        answer = client.post(d.url + "/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": kv})
        assert answer.status_code == 200  # the pull failed: recomputed
        assert d.stats()["kv_pull_failures"] == 1
        p.restart()
        assert p.port == port and p.engine_id != first_id
        assert client.get(p.url + "/health").status_code == 200
        assert p.stats()["kv_held"] == 0  # KV died with the process
        # A pull naming the old engine is refused by the new one.
        client.post(d.url + "/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": kv})
        assert p.requests("/kv/pull")[0]["status"] == 409
    assert p.returncode == 0 and d.returncode == 0


def test_process_options_faults_auth_and_stdout_log(client: httpx.Client) -> None:
    with SimProcess("prefill", speed=0, api_key="k", log="-", max_num_seqs=3, lease_s=0.2,
                    faults={"unhealthy": True}) as p:  # fmt: skip
        auth = {"Authorization": "Bearer k"}
        assert client.get(p.url + "/health", headers=auth).status_code == 503
        assert client.get(p.url + "/health").status_code == 401
        p.set_faults()
        assert client.get(p.url + "/health", headers=auth).status_code == 200
        assert client.post(p.url + "/v1/completions", json=prefill_body(), headers=auth).status_code == 200
        p.wait_for(lambda s: s["kv_expired"] == 1)
        assert p.faults()["unhealthy"] is False
    events = [json.loads(line) for line in p.output]
    assert [e["event"] for e in events] == ["request", "request", "request", "request", "kv"]
    assert events[-1]["outcome"] == "expired"


@pytest.mark.parametrize(
    "argv",
    [
        ["--role", "router"],
        ["--listen", "nowhere"],
        ["--api-key-env", "NARWHAL_SIM_TEST_SURELY_UNSET"],
        ["--speed", "-1"],
        ["--error-rate", "3"],
        ["--max-num-seqs", "0"],
        ["--no-such-flag"],
        ["--speed", "fast"],
        ["--max-num-batched-tokens", "0"],
        ["--kv-events-endpoint", "udp://x:1"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    os.environ.pop("NARWHAL_SIM_TEST_SURELY_UNSET", None)
    assert main(argv) == 2
    err = capsys.readouterr().err
    # docs/simulator.md: bad flags exit 2 with one line on stderr.
    assert err.startswith("narwhal sim: error: ") and err.endswith("\n") and err.count("\n") == 1


def test_port_in_use_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with busy_port() as port:
        assert main(["--listen", f"127.0.0.1:{port}", "--log", "none"]) == 1
    assert "cannot listen" in capsys.readouterr().err


def test_every_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(
        ["--role", "decode", "--listen", "[::1]:9000", "--speed", "2", "--num-gpu-blocks", "64",
         "--kv-lease-s", "5", "--no-prefix-caching", "--step-base-ms", "9", "--stall-after-chunks", "2",
         "--reasoning-only", "--log", "none", "--kv-pull-grace-ms", "0", "--max-num-batched-tokens", "512",
         "--no-chunked-prefill", "--kv-events-endpoint", "tcp://*:5557", "--kv-events-topic", "kv",
         "--tokenizer", "/x/tokenizer.json"]  # fmt: skip
    )
    config = config_from_args(args, environ={})
    assert (config.role, config.host, config.port, config.speed) == ("decode", "::1", 9000, 2.0)
    assert config.num_gpu_blocks == 64 and config.kv_lease_s == 5 and not config.prefix_caching
    assert config.step_base_ms == 9 and config.log is None and config.pull_grace_s == 0
    assert config.max_num_batched_tokens == 512 and not config.chunked_prefill
    assert config.kv_events_endpoint == "tcp://*:5557" and config.kv_events_topic == "kv"
    assert config.tokenizer == "/x/tokenizer.json"
    assert config.faults.stall_after_chunks == 2 and config.faults.reasoning_only
    defaults = config_from_args(build_parser().parse_args([]), environ={})
    assert defaults == SimConfig(log="stderr")


@pytest.mark.parametrize("command", [["-m", "narwhal", "sim"], ["-m", "narwhal_sim"]])
def test_a_bad_flag_prints_one_line_from_the_real_command(command: list[str]) -> None:
    done = subprocess.run([sys.executable, *command, "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "narwhal sim: error: unrecognized arguments: --no-such-flag (see --help)\n"


def test_process_with_kv_events_and_without_chunked_prefill() -> None:
    import msgpack
    import zmq

    from narwhal_sim.testing import SimProcess

    with SimProcess("mixed", speed=0, chunked_prefill=False, max_num_batched_tokens=64,
                    kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0") as sim:  # fmt: skip
        too_long = httpx.post(sim.url + "/v1/completions", json={"prompt": "x" * 400, "max_tokens": 1})
        assert too_long.status_code == 400 and "max_num_batched_tokens" in too_long.json()["error"]["message"]
        assert httpx.post(sim.url + "/v1/completions", json={"prompt": "y" * 200, "max_tokens": 1}).status_code == 200
        replay = sim.stats()["kv_events_replay_endpoint"]
        ctx = zmq.Context()
        try:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay)
            hashes: list[int] = []
            deadline = time.monotonic() + 5
            while not hashes:  # the publisher thread may not have sent the batch yet
                assert time.monotonic() < deadline
                dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                while True:
                    assert dealer.poll(5000)
                    _, seq, payload = dealer.recv_multipart()
                    if seq == (-1).to_bytes(8, "big", signed=True):
                        break
                    for event in msgpack.unpackb(payload)[1]:  # the default family's map events (vLLM PR #42892)
                        hashes += event["block_hashes"] if event["type"] == "BlockStored" else []
            assert len(hashes) == 3  # 50 tokens: 3 full blocks
            dealer.close()
        finally:
            ctx.term()
