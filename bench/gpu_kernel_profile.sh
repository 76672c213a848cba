#!/usr/bin/env bash
# Where a decode attention kernel's time goes (device machine): for each method, Nsight Compute's report of one
# launch of its split kernel (bench/decode_profile.py: Qwen3-30B-A3B's attention shape, bf16; `delta`: DeltaKV's
# decode kernel over a plan of 2048 tokens, bench/delta_decode_bench.py), and the kernel's Triton IR (TTGIR:
# layouts and conversions), PTX and SASS.
# Usage: bash bench/gpu_kernel_profile.sh "$OUT" "kivi dense fp8" [SHAPE, default 32x32768]
# (KNOBS: paged_decode's launch knobs, e.g. KNOBS=mma=1,num_splits=3 KERNEL=mma_decode_kernel for the register-mma one)
set -uo pipefail
out=${1:?output folder}; methods=${2:-kivi dense}; shape=${3:-32x32768}
cd bench
for m in $methods; do
  cache=/tmp/triton-profile-$m; rm -rf "$cache"; mkdir -p "$out/$m"
  if [[ $m == delta ]]; then
    kernel=delta_decode_kernel; cmd=(python3 delta_decode_bench.py --shapes "$shape" --reads plan)
  else
    kernel=${KERNEL:-split_kernel}; cmd=(python3 decode_profile.py --method "$m" --shape "$shape" ${KNOBS:+--knobs "$KNOBS"})
  fi
  TRITON_CACHE_DIR=$cache timeout "${PART_TIMEOUT:-150}" ncu --clock-control none --kernel-name regex:$kernel \
    --launch-skip 1 --launch-count 1 --set full --import-source yes -o "$out/$m/profile" -f \
    "${cmd[@]}" > "$out/$m/ncu.log" 2>&1
  echo "profile $m: rc=$?"; tail -2 "$out/$m/ncu.log"
  ncu --import "$out/$m/profile.ncu-rep" --page details > "$out/$m/details.txt" 2>&1
  ncu --import "$out/$m/profile.ncu-rep" --page source --csv --print-source sass > "$out/$m/source_sass.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Theoretical Occ|Issue Slots|No Eligible" \
    "$out/$m/details.txt" | head -20
  for f in $(find "$cache" -name "*$kernel*" \( -name "*.ttgir" -o -name "*.ptx" -o -name "*.cubin" \)); do
    cp "$f" "$out/$m/"
    case $f in *.cubin) cuobjdump -sass "$f" > "$out/$m/$(basename "$f" .cubin).sass" 2>&1 ;; esac
  done
  tar -czf "$out/$m.tgz" -C "$out" "$m" && rm -rf "${out:?}/$m"  # one file a kernel (the device tool returns few)
done
