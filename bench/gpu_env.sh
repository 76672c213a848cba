# Sourced from the repository root on a GPU machine that has torch, triton and transformers but no package
# index and no kvc install (a device lent over a copy of the checkout): installs the wheels packed into .whl/
# (`../shared/tools/gpu-wheels`: lark, fastapi, pydantic, ...) under /tmp/site, makes this checkout importable as
# `kvc` through a tree of links (pyproject's package-dir mapping), and defines
#   step NAME EST CMD...   run CMD if EST seconds still fit in $TOTAL (seconds since sourcing; default 560),
#                          its output in /tmp/r/NAME.log, its tail printed, /tmp/r packed into $OUT/r.tgz
#   suite ARGS...          kvc bench suite ARGS (e.g. bench/suites/issue23_engine.toml --only floor32 --out DIR)
#   detach NAME CMD...     start CMD in its own session (it outlives the device command, not the machine), its
#                          output in /tmp/r/NAME.log; for runs longer than one command (the e2e tables)
#   wait_for NAME SECS     wait until the detached NAME ends or SECS pass (then say it still runs), and pack
# so that one device command runs several suite runs and returns every result even when it stops at its limit:
#   . bench/gpu_env.sh; step tests 150 python3 -m pytest -q tests/kernels/test_pdl.py
#   step floor 200 suite bench/suites/issue23_engine.toml --only floor32 --out /tmp/r/e23
#   detach e2e python3 -m kvc.runtime.cli bench suite bench/suites/issue23_engine.toml \
#     --only e2e256_snapkv,e2e256_full --out /tmp/r/e2e
#   (then, each within the 30 s a lent machine stays warm after a command: . bench/gpu_env.sh; wait_for e2e 570)
export PYTHONUNBUFFERED=1 KVC_CACHE_DIR=${KVC_CACHE_DIR:-/tmp/kvccache}
T0=$(date +%s)
TOTAL=${TOTAL:-560}
OUT=${OUT:-/tmp/out}
if [ ! -d /tmp/site ]; then  # a later command on the same machine keeps them (a detached run may use them)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || return 1
fi
if [ ! -d /tmp/pkg/kvc ]; then  # kept for a detached run of an earlier command
  mkdir -p /tmp/pkg/kvc
  for f in runtime/_top/*; do ln -s "$PWD/$f" /tmp/pkg/kvc/; done
  for d in dsl compiler kernels_generated runtime; do ln -s "$PWD/$d" /tmp/pkg/kvc/$d; done
fi
export PYTHONPATH=/tmp/site:/tmp/pkg
python3 -c "import kvc.runtime.cli" || return 1
mkdir -p "$OUT" /tmp/r
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
pack() { tar czf "$OUT/r.tgz" -C /tmp r 2>/dev/null; }
step() {
  local name=$1 est=$2; shift 2
  local now; now=$(date +%s)
  local left=$(( TOTAL - (now - T0) ))
  if (( est > left )); then echo "SKIP $name (needs $est s, $left left)"; return; fi
  echo "== $name ($left s left)"
  timeout $(( left - 5 )) bash -c '"$@"' step "$@" > "/tmp/r/$name.log" 2>&1
  echo "rc=$? $name $(( $(date +%s) - now ))s"; tail -n 25 "/tmp/r/$name.log"; pack
}
suite() { python3 -m kvc.runtime.cli bench suite "$@"; }
export -f suite  # `step` runs its command under `timeout`, which runs programs, not shell functions: bash -c
detach() {
  local name=$1; shift
  setsid nohup bash -c '"$@"' detach "$@" > "/tmp/r/$name.log" 2>&1 < /dev/null &
  echo $! > "/tmp/r/$name.pid"; echo "detached $name (pid $!)"
}
wait_for() {
  local name=$1 secs=$2 pid; pid=$(cat "/tmp/r/$name.pid")
  local end=$(( $(date +%s) + secs ))
  while kill -0 "$pid" 2>/dev/null && (( $(date +%s) < end )); do sleep 10; done
  if kill -0 "$pid" 2>/dev/null; then echo "$name still runs"; else echo "$name ended"; fi
  tail -n 25 "/tmp/r/$name.log"; pack
}
