set -u
. scripts/gpu/lib.sh
nvcc -O3 -std=c++17 -arch=sm_90a -cubin -o /tmp/pf.cubin scripts/gpu/probes/phase_floor.cu
cuobjdump -sass /tmp/pf.cubin > /tmp/pf.sass
awk '/Function :/{f=$3; n=0} /LDG|STG|BAR|ATOM|RED|MEMBAR|FENCE|BRA|WARPSYNC|CCTL|ERRBAR/{n++; if (f ~ /Lb1E/) print f, $0}' /tmp/pf.sass | sed 's/  */ /g' | cut -c1-150 | head -150
