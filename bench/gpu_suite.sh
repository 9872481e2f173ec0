#!/usr/bin/env bash
# The learner's GPU figures in one call (docs/gpu.md): for a machine with torch and Triton but
# no DeepSpeed or pydantic, which travel as wheels in .whl/ (docs/gpu.md says how to make them).
#
#   bash bench/gpu_suite.sh [--cpu-smoke] [STEP...]
#
# STEP, in this order by default:
#   env         versions, the card, the rate of a bf16 matmul
#   dense-1.5b  bench/gpu_learner_probe.py at the Qwen2.5-1.5B shape with activation
#               checkpointing, fused then chunked token head (the fused run profiles one step)
#   dense-0.5b  the same at the Qwen2.5-0.5B shape, not profiled
#   moe         two Qwen3-30B-A3B layers at real widths, fused head, MoE blocks as ZeRO-3 leaf
#               modules off then on, parameters partitioned as docs/zero3_tuning.md's table
#               partitions a model of over 16B parameters
# The wheels in .whl/ are installed into /tmp/site first (unless --cpu-smoke). Each step runs
# under its own time limit, cut to what is left of SUITE_BUDGET_S (default 480 s from the
# start); a step that fails or runs out of time is recorded and the next one runs.
# --cpu-smoke runs every step on the CPU with tiny shapes and a tiny workload, installs
# nothing: it checks the arguments and the output, not the figures.
#
# Writes under $OUT (default /tmp/gpu_suite): log (all that is printed), results.jsonl (each
# JSON line as it comes), steps.jsonl (each step's status, exit code and wall time) and
# gpu_suite.json (all of it in one object). Prints a table of the runs last. Exits 0 when every
# step ran to its end, 1 otherwise, 2 on a bad argument.
# Environment: OUT, SUITE_BUDGET_S, STEPS (steps per run, the first one warm-up; default 3,
# the moe step's MOE_STEPS 2), MICRO (learner.micro_batch_tokens, default 16384).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/gpu_suite}
SMOKE=${GPU_SUITE_SMOKE:-0}
ALL_STEPS=(env dense-1.5b dense-0.5b moe)
ONE_STEP=
case ${1:-} in
--cpu-smoke)
    SMOKE=1
    shift
    ;;
--one-step) # how the suite runs each step, under its time limit
    ONE_STEP=${2:-}
    shift 2
    ;;
esac
SELECTED=("$@")
[[ -n $ONE_STEP ]] && SELECTED=("$ONE_STEP")
((${#SELECTED[@]})) || SELECTED=("${ALL_STEPS[@]}")
for step in "${SELECTED[@]}"; do
    if [[ " ${ALL_STEPS[*]} " != *" $step "* ]]; then
        echo "gpu_suite.sh: unknown step '$step' (steps: ${ALL_STEPS[*]}; option: --cpu-smoke)" >&2
        exit 2
    fi
done

MICRO=${MICRO:-16384}
STEPS=${STEPS:-3}
MOE_STEPS=${MOE_STEPS:-2}
export STEPS # the probe reads it
if ((SMOKE)); then
    DEVICE=cpu
    SHAPE_15B=tiny SHAPE_05B=tiny SHAPE_MOE=moe-tiny
    WORKLOAD=(--prompts 2 --max-response 64)
    STEPS=2 MOE_STEPS=2 MICRO=2048
else
    DEVICE=cuda
    SHAPE_15B=1.5b SHAPE_05B=0.5b SHAPE_MOE=30b-a3b-2l
    WORKLOAD=()
fi
RESULTS=$OUT/results.jsonl
STATUS=$OUT/steps.jsonl

probe() { # SHAPE ARGS...: one probe process, its JSON lines appended to results.jsonl
    local shape=$1
    shift
    python3 "$ROOT/bench/gpu_learner_probe.py" "$shape" "$MICRO" grpo --device "$DEVICE" \
        --out "$RESULTS" ${WORKLOAD[@]+"${WORKLOAD[@]}"} "$@"
}

env_step() {
    ((SMOKE)) || nvidia-smi --format=csv \
        --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit
    # -P: not the working directory first on sys.path, whose groupflow/ lacks the mapped folders
    python3 -P - "$DEVICE" "$RESULTS" <<'EOF'
import importlib, json, os, platform, sys

device, results = sys.argv[1], sys.argv[2]
os.environ.setdefault("DS_ACCELERATOR", device)
import torch

record = {"step": "env", "python": platform.python_version(), "torch": torch.__version__,
          "torch_cuda": torch.version.cuda, "device": device}
for name in ("triton", "deepspeed", "transformers", "pydantic"):
    try:
        record[name] = importlib.import_module(name).__version__
    except Exception as err:  # recorded; the probes fail on it too
        record[name] = f"import failed: {err!r}"[:300]
import groupflow.learner.rank as rank

record["groupflow_learner"] = os.path.dirname(os.path.realpath(rank.__file__))
if device == "cuda":
    props = torch.cuda.get_device_properties(0)
    record.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                  multiprocessors=props.multi_processor_count)
    # The matmul ceiling of docs/.../METHOD.md: 8192^3 in bf16 on random data, median of 10.
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    record["matmul_bf16_tflops"] = round(2 * 8192**3 / sorted(times)[5] / 1e12, 1)
print(json.dumps(record), flush=True)
with open(results, "a") as f:
    f.write(json.dumps(record) + "\n")
EOF
}

if [[ -n $ONE_STEP ]]; then
    case $ONE_STEP in
    env) env_step ;;
    dense-1.5b) probe "$SHAPE_15B" --heads fused,chunked --profile ;;
    dense-0.5b) probe "$SHAPE_05B" --heads fused,chunked ;;
    # docs/zero3_tuning.md's row for a model of over 16B parameters, what a real
    # Qwen3-30B-A3B gets on several ranks: so that ZeRO-3 gathers the MoE blocks at all here.
    moe) STEPS=$MOE_STEPS probe "$SHAPE_MOE" --heads fused --moe-leaf off,on \
        --set learner.zero3.param_persistence_threshold=100000 \
        --set learner.zero3.prefetch_bucket_size=50000000 \
        --set learner.zero3.max_live_parameters=1000000000 ;;
    esac
    exit
fi

BUDGET=${SUITE_BUDGET_S:-480}
START=$(date +%s)
RESERVE=15 # seconds kept for the summary
declare -A LIMIT=([install]=60 [env]=90 [dense-1.5b]=270 [dense-0.5b]=150 [moe]=180)
mkdir -p "$OUT"
: >"$RESULTS"
: >"$STATUS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OUT GPU_SUITE_SMOKE=$SMOKE MICRO STEPS MOE_STEPS

# groupflow importable from this checkout without installing it: pyproject.toml's package-dir
# maps actors/, rollout/, learner/ and reward_workers/ to groupflow.<name>.
SHIM=$(mktemp -d /tmp/gpu_suite_shim.XXXXXX)
mkdir -p "$SHIM/groupflow"
cat >"$SHIM/groupflow/__init__.py" <<EOF
__path__ = ["$ROOT/groupflow", "$SHIM/groupflow"]
exec(compile(open("$ROOT/groupflow/__init__.py").read(), "$ROOT/groupflow/__init__.py", "exec"))
EOF
for sub in actors rollout learner reward_workers; do
    ln -s "$ROOT/$sub" "$SHIM/groupflow/$sub"
done
export PYTHONPATH=$SHIM${PYTHONPATH:+:$PYTHONPATH}
((SMOKE)) || export PYTHONPATH=/tmp/site:$PYTHONPATH

run_step() { # NAME COMMAND...: under the smaller of the step's limit and what is left
    local name=$1
    shift
    local limit=${LIMIT[$name]} left=$((START + BUDGET - RESERVE - $(date +%s)))
    if ((left < 30)); then
        echo "=== $name: skipped, ${left}s of the suite's budget left"
        printf '{"step": "%s", "status": "skipped", "rc": null, "wall_s": 0, "limit_s": %d}\n' \
            "$name" "$left" >>"$STATUS"
        return
    fi
    ((limit > left)) && limit=$left
    echo "=== $name: limit ${limit}s, $(date -u +%H:%M:%S) UTC, $(($(date +%s) - START))s into the suite"
    local began rc status
    began=$(date +%s)
    timeout -k 10 "$limit" "$@"
    rc=$?
    case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
    esac
    echo "=== $name: $status (exit $rc) in $(($(date +%s) - began))s"
    printf '{"step": "%s", "status": "%s", "rc": %d, "wall_s": %d, "limit_s": %d}\n' \
        "$name" "$status" "$rc" "$(($(date +%s) - began))" "$limit" >>"$STATUS"
}

summary() {
    python3 - "$OUT" "$SMOKE" "$BUDGET" "$(($(date +%s) - START))" <<'EOF'
import json, sys, time

out, smoke, budget, wall = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


records = lines(f"{out}/results.jsonl")
figures = {
    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "cpu_smoke": smoke,
    "budget_s": budget,
    "wall_s": wall,
    "steps": lines(f"{out}/steps.jsonl"),
    "env": next((r for r in records if r.get("step") == "env"), None),
    "shapes": [r for r in records if "params" in r],
    "runs": [r for r in records if "setting" in r],
}
with open(f"{out}/gpu_suite.json", "w") as f:
    json.dump(figures, f, indent=1)
env = figures["env"] or {}
print(f"card: {env.get('gpu', env.get('device'))}; torch {env.get('torch')}, triton "
      f"{env.get('triton')}, deepspeed {env.get('deepspeed')}, transformers "
      f"{env.get('transformers')}; bf16 matmul {env.get('matmul_bf16_tflops')} TFLOP/s")
for s in figures["steps"]:
    print(f"step {s['step']:<11} {s['status']:<8} {s['wall_s']:>4}s of {s['limit_s']}s")
row = "{:<11}{:<8}{:<5}{:>8}{:>7}{:>8}{:>9}{:>11}{:>9}{:>5}  {}"
print(row.format("shape", "head", "leaf", "tok/s", "MFU", "TFLOP/s", "peak GiB", "syncs/step",
                 "syncs/mb", "mbs", "step s"))
for r in figures["runs"]:
    if "error" in r:
        print(f"{r['shape']:<11}{r['token_head']:<8}{r.get('moe_leaf', '-'):<5}  "
              f"error: {r['error'][:300]}")
        continue
    print(row.format(r["shape"], r["token_head"], r.get("moe_leaf", "-"), r["tokens_per_s"],
                     str(r["mfu"]), r["tflops"], str(r["peak_gib"]), str(r["syncs_per_step"]),
                     str(r["syncs_per_micro_batch"]), r["micro_batches"], r["step_s"]))
views = (("profile_kernels", "kernels by GPU time"), ("profile_ops_by_gpu", "operators by the GPU "
         "time they launched"), ("profile_ops_by_host", "operators by their own host time"))
for r in figures["runs"]:
    if "profile_step_ms" in r:
        print(f"profile of one {r['shape']} {r['token_head']} step: {r['profile_step_ms']} ms "
              f"wall, {r['profile_gpu_ms']} ms of kernels, {r['profile_host_ms']} ms on the host")
    for key, title in views:
        if r.get(key):
            print(f" {title}:")
        for e in r.get(key, ()):
            print(f"  {e['share']:>6.1%} {e['ms']:>9.1f} ms {e['calls']:>6}x  {e['name']}")
    if r.get("per_micro_batch_sites"):
        print(f"{r['shape']} {r['token_head']}: sites syncing every micro-batch: "
              f"{r['per_micro_batch_sites']}")
print(f"figures: {out}/gpu_suite.json")
EOF
}

main() {
    echo "gpu_suite.sh: steps ${SELECTED[*]}; device $DEVICE; budget ${BUDGET}s; out $OUT; root $ROOT"
    if ((!SMOKE)); then
        if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
            ls -l "$ROOT"/.whl/
            run_step install python3 -m pip install -q --no-index --no-deps --no-compile \
                --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/*.whl
        else
            echo "no wheels in $ROOT/.whl: DeepSpeed and pydantic must be there already"
        fi
    fi
    for step in "${SELECTED[@]}"; do
        run_step "$step" bash "$ROOT/bench/gpu_suite.sh" --one-step "$step"
    done
    summary
    ! grep -qv '"status": "ok"' "$STATUS"
}

mkdir -p "$OUT"
main 2>&1 | tee "$OUT/log"
rc=${PIPESTATUS[0]}
rm -rf "$SHIM"
exit "$rc"
