set -u
. scripts/gpu/lib.sh
nvcc -O3 -std=c++17 -arch=sm_90a -cubin -o /tmp/pf.cubin scripts/gpu/probes/phase_floor.cu
cuobjdump -sass /tmp/pf.cubin | awk '/Function :/{f=$3} /LDG/{print f, $2, $3}' | sort | uniq -c | head
bash scripts/gpu/phase-floor.sh 2>&1 | tail -30
