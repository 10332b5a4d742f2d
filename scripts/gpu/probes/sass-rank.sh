#!/usr/bin/env bash
# The SASS of select_mlp_block's ranking loop (select_common.cuh's rank_tokens), compiled on the
# GPU machine (which has the full toolkit: this machine has no cuobjdump): the loop bodies that
# compare keys, to count their instructions. Repo root; no bundle needed.
set -u
export PATH=/usr/local/cuda/bin:$PATH
nvcc --cubin -O3 -std=c++17 -Icandle-ragged/kernels -arch=sm_90 -o /tmp/fp.cubin candle-fastpath/kernels/fastpath.cu
cuobjdump -sass -fun fastpath_select_mlp_block_f16_c192 /tmp/fp.cubin > /tmp/sel.sass
wc -l /tmp/sel.sass
# Loops whose bodies hold a shared load and a signed compare: print each backward branch's body.
python3 - <<'P'
import re
lines=open('/tmp/sel.sass').read().splitlines()
ins=[]
for l in lines:
    m=re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?);',l)
    if m: ins.append((int(m.group(1),16),m.group(2).strip()))
addr={a:i for i,(a,_) in enumerate(ins)}
for i,(a,t) in enumerate(ins):
    m=re.search(r'BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))',t)
    tgt=None
    mm=re.search(r'0x([0-9a-f]+)',t) if 'BRA' in t else None
    if mm: tgt=int(mm.group(1),16)
    if tgt is not None and tgt<a and tgt in addr:
        body=ins[addr[tgt]:i+1]
        if any('LDS' in x for _,x in body) and any('ISETP' in x for _,x in body) and len(body)<200:
            print(f"== loop {tgt:#x}..{a:#x}: {len(body)} instructions, LDS {sum('LDS' in x for _,x in body)}, ISETP {sum('ISETP' in x for _,x in body)}")
            for _,x in body: print('   ',x)
P
