//! The launch shape of the resident attention kernel (`kernels/ragged_attention.cu`): how many
//! blocks, warps per block, key parts and bytes of shared memory a batch gets. Pure host
//! arithmetic from values the host already knows (batch size, heads, longest sequence, SM
//! count), kept out of the CUDA module so that its rules are unit-tested on every machine.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// Longest sequence the resident kernel takes (RESIDENT_MAX_LEN in the kernel source); longer
/// batches use the tiled kernel.
pub(crate) const RESIDENT_MAX_LEN: usize = 256;
/// Most warps per resident block (RESIDENT_MAX_WARPS in the kernel source), 16 query rows each.
pub(crate) const RESIDENT_MAX_WARPS: usize = 8;
/// Warps sharing one query tile's keys in lever 16's split (see [`resident_key_parts`]).
pub(crate) const KEY_PARTS: usize = 4;
/// The larger split of lever 29.
const KEY_PARTS_WIDE: usize = 8;
/// Below this many warps per SM (one block per (sequence, head), two query tiles a warp) a batch
/// gets two blocks per (sequence, head) and a tile per warp (see [`resident_plan`]).
/// `CANDLE_RAGGED_SPLIT_BELOW` overrides it (A/B knob). Lever 109 (H100, bench-attention f16,
/// two rounds, `scripts/gpu/ab-split-below.sh`) moved it from 8 to 11: DeiT-T at batch 64 (3
/// heads, 197 tokens: 192 blocks of 7 warps, ~10 warps a SM) then splits, 22.9 → 20.2 µs, and its
/// batch-64 graphs gain 2–3 %; at 12 and above 6 heads at batch 64 and keep 0.5 (384 blocks of 4
/// warps) splits too and loses (16.5 → 18.2 µs).
pub(crate) const SPLIT_BELOW_WARPS_PER_SM: usize = 11;

/// Most warps per block for which the plan takes lever 135's paired kernel (each warp's two
/// query tiles at once: [`ResidentPlan::paired`]); `CANDLE_RAGGED_PAIR_WARPS` overrides it (A/B
/// knob; 0 never pairs). Lever 135 (H100, bench-attention, f16 and bf16, 6 / 12 heads, batch
/// 64 / 256, two rounds, the paired kernel forced on every launch): 4-warp blocks (keep 0.5:
/// sequences of up to 128 tokens) 1.01–1.09× faster in all eight cells, 5-warp blocks (keep 0.7)
/// 0.86–1.15×, 7-warp blocks (keep 1.0, one block a SM at 168 registers) 0.81–0.91×.
pub(crate) const PAIR_MAX_WARPS: usize = 4;

/// (Sequence, head) pairs per SM from which every unsplit block with a two-tile warp takes
/// lever 136's paired form, Q's rows staged in shared memory (128 registers: 16 warps a SM, not
/// 12, two chains each); `CANDLE_RAGGED_PAIRQ_PAIRS` overrides it (A/B knob; 0 every such
/// block, a large value never). Lever 136's first A/B (H100, bench-attention f16, 6 / 12 heads,
/// every unsplit block on that form against lever 135's plan, two rounds): 1,536 and 3,072
/// pairs (11.6 and 23.3 a SM) 0.99–1.09× (keep 1.0: 7-warp blocks 1.09×, 12 heads keep 0.7
/// 108.0 → 101.7 µs), 384 and 768 pairs (2.9 and 5.8 a SM) 0.86–1.05× (6 heads keep 1.0
/// 0.86×: 384 blocks the SMs hold at once with the 80-register kernel, not with this one).
pub(crate) const PAIRQ_MIN_PAIRS_PER_SM: usize = 8;

/// Warps per block from which unsplit blocks with a two-tile warp take lever 136's form at any
/// batch (under the wave check of [`resident_plan`]); `CANDLE_RAGGED_PAIRQ_WARPS` overrides it
/// (A/B knob; 9 never). Lever 137's call (H100, bench-attention, f16 and bf16, two rounds; its
/// arm `CANDLE_RAGGED_PAIRQ_PAIRS=0` against the plan of before) found blocks of 5 and 7 warps
/// (keep 0.7 and 1.0) 1.00–1.08× faster staged below 8 pairs a SM too (3 heads at batch 256, 6
/// and 12 at batch 64), blocks of 3 and 4 warps 0.91–0.97× at 3 heads batch 256.
pub(crate) const PAIRQ_MIN_WARPS: usize = 5;

/// Warps an SM holds of a kernel built for `regs` registers a thread: registers are allocated
/// per SM sub-partition (four of 16,384), in whole warps.
const fn warps_per_sm(regs: usize) -> usize {
    4 * (16384 / (regs * 32))
}
/// The 96-register resident kernel (`__maxnreg__(96)`): 20 warps a SM.
const RESIDENT_WARPS_PER_SM: usize = warps_per_sm(96);
/// The 80-register resident kernel (`__maxnreg__(80)`): 24 warps a SM.
const LOW_REGISTER_WARPS_PER_SM: usize = warps_per_sm(80);
/// The paired kernel (`__maxnreg__(168)`): 12 warps a SM.
const PAIRED_WARPS_PER_SM: usize = warps_per_sm(168);
/// The paired kernel with Q staged in shared memory (`__maxnreg__(128)`): 16 warps a SM.
const PAIRQ_WARPS_PER_SM: usize = warps_per_sm(128);

/// Blocks of `warps` warps and `smem` bytes of dynamic shared memory an SM holds at once, for a
/// kernel of which it holds `warps_per_sm` warps and an SM of `smem_per_sm` bytes (1 KB of it
/// reserved per block).
fn blocks_per_sm(warps: usize, smem: usize, warps_per_sm: usize, smem_per_sm: usize) -> usize {
    (warps_per_sm / warps).min(smem_per_sm / (smem + 1024))
}

/// The plan's tunables, each an environment knob for A/B measurements (read once per device).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct PlanKnobs {
    /// Most key parts per query tile (`CANDLE_RAGGED_KEY_PARTS`): see [`resident_key_parts`].
    pub max_parts: usize,
    /// The split threshold in warps per SM (`CANDLE_RAGGED_SPLIT_BELOW`): see [`resident_plan`].
    pub split_below: usize,
    /// Most warps per block that pair their tiles in lever 135's form
    /// (`CANDLE_RAGGED_PAIR_WARPS`): [`PAIR_MAX_WARPS`].
    pub pair_max_warps: usize,
    /// Pairs per SM from which unsplit blocks take lever 136's form
    /// (`CANDLE_RAGGED_PAIRQ_PAIRS`): [`PAIRQ_MIN_PAIRS_PER_SM`].
    pub pairq_min_pairs_per_sm: usize,
    /// Warps per block from which they take it at any batch (`CANDLE_RAGGED_PAIRQ_WARPS`):
    /// [`PAIRQ_MIN_WARPS`].
    pub pairq_min_warps: usize,
}

impl Default for PlanKnobs {
    fn default() -> Self {
        Self {
            max_parts: KEY_PARTS_WIDE,
            split_below: SPLIT_BELOW_WARPS_PER_SM,
            pair_max_warps: PAIR_MAX_WARPS,
            pairq_min_pairs_per_sm: PAIRQ_MIN_PAIRS_PER_SM,
            pairq_min_warps: PAIRQ_MIN_WARPS,
        }
    }
}

/// What the plan needs to know of the GPU, queried once per device.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct GpuLimits {
    /// Streaming multiprocessors.
    pub sm_count: usize,
    /// Shared memory of an SM in bytes (228 KB on the H100).
    pub smem_per_sm: usize,
    /// Most dynamic shared memory one block may opt into (227 KB on the H100, 163 KB on the
    /// A100, 99 KB on compute capability 8.6 / 8.9): no plan asks for more, and a batch whose K
    /// and V alone would need more takes the tiled kernel.
    pub smem_per_block: usize,
}

impl GpuLimits {
    /// These limits, or those of a GPU whose blocks may opt into `kb` KB and whose SMs hold one
    /// KB more (as on compute capability 8.0, 8.6 and 8.9) where that is lower: what
    /// `CANDLE_RAGGED_GPU_SMEM_KB` passes, so that the plans of a smaller GPU run on this one
    /// (tests of the fallbacks on real hardware). `None` or a value that is not a number: as
    /// they are.
    pub(crate) fn capped_kb(self, kb: Option<&str>) -> Self {
        match kb.and_then(|v| v.trim().parse::<usize>().ok()) {
            Some(kb) => Self {
                smem_per_block: self.smem_per_block.min(kb * 1024),
                smem_per_sm: self.smem_per_sm.min((kb + 1) * 1024),
                ..self
            },
            None => self,
        }
    }
}

/// Shared memory of a resident block: K and V rows (head_dim + 8 elements, padded so ldmatrix
/// is conflict-free) for the longest sequence rounded up to 16 keys.
pub(crate) fn resident_smem_bytes(max_len: usize, head_dim: usize) -> usize {
    2 * max_len.next_multiple_of(16) * (head_dim + 8) * 2
}

/// The resident kernel's key parts (its blockDim.y) and query-tile warps per block for a batch of
/// `pairs` (sequence, head) pairs of up to `q_tiles` 16-row tiles (and as many 16-key tiles):
/// several warps share each tile's keys when the whole batch is a small fraction of a wave of
/// warps (`sm_count` SMs × 16 resident warps), as at batch 1, where one warp's chain over all
/// keys is the kernel's time; otherwise 1 (`None`).
/// - 8 parts (one tile per block) when they fit in half a wave: DeiT-T and DeiT-S at batch 1
///   (lever 29, H100: ncu 9.44 → 8.54 µs at 3 heads, 9.31 → 8.86 µs at 6; graph replays
///   1.00–1.03× faster). Past half a wave each tile re-staging the whole K / V costs more than the
///   shorter chain saves (12 heads at batch 1: 0.86–0.92× in bench-attention, DeiT-B 0.98–1.00×);
/// - else 4 parts (two tiles per block) within a wave (lever 16);
/// - 2 parts were measured too: slower than none at batch 8 with 6 heads.
///
/// `max_parts` (`CANDLE_RAGGED_KEY_PARTS`, for A/B): 1 turns parts off, 4 keeps lever 16's rule.
pub(crate) fn resident_key_parts(
    pairs: usize,
    q_tiles: usize,
    sm_count: usize,
    max_parts: usize,
) -> Option<(usize, usize)> {
    [(KEY_PARTS_WIDE, 8 * sm_count), (KEY_PARTS, 16 * sm_count)]
        .into_iter()
        .filter(|&(p, _)| p <= max_parts)
        .find(|&(p, warps)| q_tiles >= p && pairs * q_tiles * p <= warps)
        .map(|(p, _)| (p, RESIDENT_MAX_WARPS / p))
}

/// Shared memory the key parts' merge adds after K and V: per tile warp, the online-softmax
/// state (head_dim / 2 accumulators and four row scalars per lane) of every part but the first.
pub(crate) fn resident_merge_bytes(warps: usize, parts: usize, head_dim: usize) -> usize {
    warps * (parts - 1) * (head_dim / 2 + 4) * 32 * 4
}

/// What a key-part launch needs at most (over the splits [`resident_key_parts`] makes): with
/// [`resident_smem_bytes`] at [`RESIDENT_MAX_LEN`], the opt-in the kernels get when they load.
pub(crate) fn resident_merge_max_bytes(head_dim: usize) -> usize {
    [KEY_PARTS, KEY_PARTS_WIDE]
        .into_iter()
        .map(|p| resident_merge_bytes(RESIDENT_MAX_WARPS / p, p, head_dim))
        .max()
        .unwrap_or(0)
}

/// Shared memory of a block of lever 136's form: Q's rows staged after K and V, as many bytes
/// as K's.
fn resident_staged_q_bytes(max_len: usize, head_dim: usize) -> usize {
    resident_smem_bytes(max_len, head_dim) * 3 / 2
}

/// The dynamic shared memory the resident kernels opt into when they load: the most any plan
/// asks for (K and V at [`RESIDENT_MAX_LEN`] with the key parts' merge, or with Q staged too).
pub(crate) fn resident_opt_in_bytes(head_dim: usize) -> usize {
    (resident_smem_bytes(RESIDENT_MAX_LEN, head_dim) + resident_merge_max_bytes(head_dim))
        .max(resident_staged_q_bytes(RESIDENT_MAX_LEN, head_dim))
}

/// Which resident kernel runs a plan; its value is the kernel's index among those loaded.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum ResidentKernel {
    /// The 96-register kernel (lever 35).
    R96 = 0,
    /// The 80-register kernel (lever 24's bound; since lever 38 it also rescales its online
    /// softmax lazily).
    R80 = 1,
    /// Lever 135's paired kernel: each warp takes its two query tiles at once, every K / V
    /// fragment feeding both (168 registers). Only without key parts or splits, in blocks of
    /// which some warp has two tiles.
    Paired = 2,
    /// The paired kernel in lever 136's form: Q's rows staged in shared memory after K and V
    /// (which the launch's shared memory then holds too), its fragments loaded per key chunk, so
    /// that it fits 128 registers.
    PairedStagedQ = 3,
}

/// One resident launch: CUDA's grid (x, heads, batch) and block (x: warps · 32, y: key parts),
/// the dynamic shared memory, and the kernel.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct ResidentPlan {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
    pub kernel: ResidentKernel,
}

/// Whether a launch of `blocks` blocks of `warps` warps (no key parts) takes the 80-register
/// kernel. Registers are allocated per SM sub-partition (16,384, whole warps): 96 registers hold
/// 20 warps per SM, 80 hold 24. From 6 warps per block that is one block per SM fewer at 96
/// (7 warps: two instead of three), which costs more than the spills of the 80-register form
/// once the grid needs more than the 96-register kernel holds at once (two blocks per SM).
/// Lever 35, one A/B call on the H100 (f16, bench-attention GPU µs, 96 / 80 registers): 6 heads
/// batch 64 keep 1.0 (384 blocks of 7 warps) 37.5 / 32.0, 12 heads batch 256 keep 1.0 191.0 /
/// 185.7; with fewer warps per block the 96-register kernel wins (12 heads batch 256, keep 0.7:
/// 107.3 / 117.7, keep 0.5: 74.0 / 81.9), as it does for grids that fit at once (3 heads batch 64
/// keep 1.0: 21.7 / 24.3).
fn wants_low_registers(warps: usize, blocks: usize, sm_count: usize) -> bool {
    warps >= 6 && blocks > 2 * sm_count
}

/// The launch of a batch of `batch` sequences (the longest `max_len` ≤ [`RESIDENT_MAX_LEN`]
/// tokens) over `heads` heads of `head_dim` ≤ 64:
/// - key parts when [`resident_key_parts`] splits (one query tile per warp of a part, so that
///   every tile of the longest sequence has its warps);
/// - else one block per (sequence, head) whose warps take two 16-row query tiles each (a block
///   holds its shared memory until its slowest warp ends, so the tiles must spread evenly), or,
///   when that would leave SMs idle (under `split_below` warps a SM,
///   [`SPLIT_BELOW_WARPS_PER_SM`] by default; 20–24 fit), two
///   blocks per (sequence, head) and a tile per warp;
/// - one block per (sequence, head) of at most `knobs.pair_max_warps` warps takes the paired
///   kernel when some warp has two tiles, unless the grid fits the SMs at once with the
///   kernel it would take unpaired and not with the paired one (which holds 12 warps a SM, not
///   20). Lever 135's second A/B (H100, `CANDLE_RAGGED_PAIR_WARPS=0` against 4, 3 / 6 / 12
///   heads, batch 64 / 256, keep 0.3 / 0.5, f16 and bf16, two rounds) found exactly those grids
///   slower paired:
///   768 blocks of 3 warps (3 heads at batch 256 and 12 at 64, keep 0.3) 0.89–0.90×, against
///   1.02–1.18× where the paired grid takes no more waves than the other or both take several,
///   and ~1.00 at 3 heads batch 64;
/// - from `knobs.pairq_min_pairs_per_sm` pairs a SM ([`PAIRQ_MIN_PAIRS_PER_SM`]) every such
///   block with a two-tile warp, whatever its warps, takes the paired kernel in lever 136's form
///   (Q staged in shared memory: 16 warps a SM), under the same wave check; so do blocks of at
///   least `knobs.pairq_min_warps` warps ([`PAIRQ_MIN_WARPS`]) at any batch. Lever 135 found
///   the kernel bound by the dependent chains an SM keeps in flight, not by its instructions;
///   this form holds a third more of them, which pays once the grid takes several waves.
///
/// Within `gpu.smem_per_block`: key parts only as many as their merge fits (8, else 4, else
/// none), Q staged only where it fits, and `None` (the tiled kernel) where K and V alone do not
/// (at head_dim 64, sequences past 224 tokens where a block may hold only 64 KB).
pub(crate) fn resident_plan(
    batch: usize,
    heads: usize,
    max_len: usize,
    head_dim: usize,
    gpu: GpuLimits,
    knobs: PlanKnobs,
) -> Option<ResidentPlan> {
    let GpuLimits {
        sm_count,
        smem_per_sm,
        smem_per_block,
    } = gpu;
    let pairs = batch * heads;
    let q_tiles = max_len.div_ceil(16);
    let kv = resident_smem_bytes(max_len, head_dim);
    if kv > smem_per_block {
        return None;
    }
    let key_parts = [knobs.max_parts, knobs.max_parts.min(KEY_PARTS)]
        .into_iter()
        .filter_map(|max_parts| resident_key_parts(pairs, q_tiles, sm_count, max_parts))
        .map(|(parts, warps)| {
            (
                parts,
                warps,
                kv + resident_merge_bytes(warps, parts, head_dim),
            )
        })
        .find(|&(_, _, smem)| smem <= smem_per_block);
    if let Some((parts, warps, smem)) = key_parts {
        return Some(ResidentPlan {
            grid: (q_tiles.div_ceil(warps) as u32, heads as u32, batch as u32),
            block: ((warps * 32) as u32, parts as u32, 1),
            shared_mem_bytes: smem as u32,
            // At most a wave of warps: occupancy does not bound it.
            kernel: ResidentKernel::R96,
        });
    }
    let warps = q_tiles.div_ceil(2).clamp(1, RESIDENT_MAX_WARPS);
    let splits = if pairs * warps < knobs.split_below * sm_count {
        q_tiles.div_ceil(warps).clamp(1, 2)
    } else {
        1
    };
    // Unsplit blocks of which some warp has two query tiles may pair them. `fits(w, smem)`:
    // whether the grid fits the SMs at once with a kernel of which an SM holds `w` warps;
    // `fits_unpaired`: with the kernel the block would take unpaired.
    let pairable = splits == 1 && q_tiles > warps;
    let fits = |warps_per_sm, smem| {
        pairs <= sm_count * blocks_per_sm(warps, smem, warps_per_sm, smem_per_sm)
    };
    let unpaired = if wants_low_registers(warps, splits * pairs, sm_count) {
        ResidentKernel::R80
    } else {
        ResidentKernel::R96
    };
    let fits_unpaired = fits(
        if unpaired == ResidentKernel::R80 {
            LOW_REGISTER_WARPS_PER_SM
        } else {
            RESIDENT_WARPS_PER_SM
        },
        kv,
    );
    let staged = resident_staged_q_bytes(max_len, head_dim);
    let kernel = if pairable
        && staged <= smem_per_block
        && (pairs >= knobs.pairq_min_pairs_per_sm.saturating_mul(sm_count)
            || warps >= knobs.pairq_min_warps)
        && (fits(PAIRQ_WARPS_PER_SM, staged) || !fits_unpaired)
    {
        ResidentKernel::PairedStagedQ
    } else if pairable
        && warps <= knobs.pair_max_warps
        && (fits(PAIRED_WARPS_PER_SM, kv) || !fits_unpaired)
    {
        ResidentKernel::Paired
    } else {
        unpaired
    };
    Some(ResidentPlan {
        grid: (splits as u32, heads as u32, batch as u32),
        block: ((warps * 32) as u32, 1, 1),
        shared_mem_bytes: (if kernel == ResidentKernel::PairedStagedQ {
            staged
        } else {
            kv
        }) as u32,
        kernel,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // The plan's kernel as the questions the tests ask of it.
    impl ResidentPlan {
        /// Whether the plan runs the 80-register kernel.
        fn low_registers(&self) -> bool {
            self.kernel == ResidentKernel::R80
        }
        /// Whether it runs the paired kernel, in either form.
        fn paired(&self) -> bool {
            matches!(
                self.kernel,
                ResidentKernel::Paired | ResidentKernel::PairedStagedQ
            )
        }
        /// Whether it runs the paired kernel with Q staged in shared memory.
        fn stages_q(&self) -> bool {
            self.kernel == ResidentKernel::PairedStagedQ
        }
    }

    const H100: GpuLimits = GpuLimits {
        sm_count: 132,
        smem_per_sm: 228 * 1024,
        smem_per_block: 227 * 1024,
    };

    fn plan(batch: usize, heads: usize, max_len: usize, max_parts: usize) -> ResidentPlan {
        let knobs = PlanKnobs {
            max_parts,
            ..PlanKnobs::default()
        };
        resident_plan(batch, heads, max_len, 64, H100, knobs).unwrap()
    }

    #[test]
    fn deit_shapes_get_the_measured_splits() {
        // DeiT-T / DeiT-S at batch 1: 8 parts, one tile per block (lever 29).
        for heads in [3, 6] {
            let p = plan(1, heads, 197, 8);
            assert_eq!((p.block, p.grid), ((32, 8, 1), (13, heads as u32, 1)));
        }
        // DeiT-B at batch 1 and DeiT-T at batch 8: 8 parts would pass half a wave, 4 fit.
        assert_eq!(plan(1, 12, 197, 8).block, (64, 4, 1));
        assert_eq!(plan(8, 3, 197, 8).block, (64, 4, 1));
        // `CANDLE_RAGGED_KEY_PARTS=4`: lever 16's split; `=1`: none.
        assert_eq!(plan(1, 3, 197, 4).block, (64, 4, 1));
        assert_eq!(plan(1, 3, 197, 1).block.1, 1);
        // DeiT-S at batch 8 fills more than a wave: no parts, two blocks per (sequence, head).
        assert_eq!(
            plan(8, 6, 197, 8),
            ResidentPlan {
                grid: (2, 6, 8),
                block: (7 * 32, 1, 1),
                shared_mem_bytes: resident_smem_bytes(197, 64) as u32,
                kernel: ResidentKernel::R96,
            }
        );
        // Batch 256: one block of 7 warps per (sequence, head), on the 80-register kernel
        // (three blocks per SM instead of two) before lever 136, paired with Q staged since.
        assert_eq!(plan(256, 12, 197, 8).grid, (1, 12, 256));
        assert_eq!(plan(256, 12, 197, 8).block, (7 * 32, 1, 1));
        assert!(plan135(256, 12, 197).low_registers());
        assert!(plan(256, 12, 197, 8).stages_q());
        // Lever 35's measured cells: 7-warp blocks past two per SM take the 80-register kernel;
        // 5-warp blocks (keep 0.7), 4-warp blocks (keep 0.5) and grids that fit at two blocks
        // per SM the 96-register one (before levers 137–138 staged Q in the longer ones).
        assert!(plan(64, 6, 197, 8).low_registers());
        assert!(plan135(64, 12, 197).low_registers());
        assert!(!plan(32, 3, 197, 8).low_registers());
        // Lever 109: DeiT-T at batch 64 (192 pairs of 7 warps, under 11 warps a SM) splits, its
        // 384 blocks on the 80-register kernel (three a SM, one wave); 6 heads at batch 64 and
        // keep 0.5 (384 pairs of 4 warps) does not.
        assert_eq!(plan(64, 3, 197, 8).grid, (2, 3, 64));
        assert!(plan(64, 3, 197, 8).low_registers());
        assert_eq!(plan(64, 6, 113, 8).grid, (1, 6, 64));
        assert!(!plan(256, 12, 159, 8).low_registers());
        assert!(!plan(256, 12, 113, 8).low_registers());
        // Key parts (batch 1): a wave at most, never the low-register kernel.
        assert!(!plan(1, 12, 197, 8).low_registers());
    }

    /// Lever 135's rule alone (lever 136's form out of reach).
    fn plan135(batch: usize, heads: usize, max_len: usize) -> ResidentPlan {
        let knobs = PlanKnobs {
            pairq_min_pairs_per_sm: usize::MAX,
            pairq_min_warps: usize::MAX,
            ..PlanKnobs::default()
        };
        resident_plan(batch, heads, max_len, 64, H100, knobs).unwrap()
    }

    #[test]
    fn short_sequences_at_large_batches_pair_their_tiles() {
        // Lever 135's measured cells: keep 0.5 (lengths up to 113 tokens: 4-warp blocks) pairs,
        // keep 0.7 (159: 5 warps) and keep 1.0 (197: 7 warps) do not.
        for heads in [6, 12] {
            for batch in [64, 256] {
                let p = plan135(batch, heads, 113);
                assert!(p.paired() && !p.low_registers() && !p.stages_q(), "{p:?}");
                assert_eq!(p.kernel, ResidentKernel::Paired);
                assert_eq!((p.grid.0, p.block.0), (1, 4 * 32));
                assert!(!plan135(batch, heads, 159).paired());
                assert!(!plan135(batch, heads, 197).paired());
            }
        }
        // Keep 0.3 (69 tokens: 3-warp blocks): 768 blocks fit the SMs at once with the
        // 96-register kernel (six a SM) but not paired (four): no pairing there; more blocks
        // pair, fewer split (two blocks per (sequence, head), a tile per warp).
        assert!(!plan135(256, 3, 69).paired());
        assert!(!plan135(64, 12, 69).paired());
        assert!(plan135(256, 6, 69).paired() && plan135(256, 12, 69).paired());
        for heads in [3, 6] {
            let p = plan135(64, heads, 69);
            assert!(p.grid.0 == 2 && !p.paired(), "{p:?}");
        }
        // Keep 0.5 at 768 blocks of 4 warps: more than a wave either way, paired.
        assert!(plan135(256, 3, 113).paired() && plan135(64, 12, 113).paired());
        // DeiT's pruned stages at batch 256: 98 and 69 tokens pair.
        assert!(plan135(256, 6, 98).paired());
        assert!(plan135(256, 6, 69).paired());
        // No warp with two tiles (16 tokens), a split batch (DeiT-T at batch 64 keeps two blocks
        // per (sequence, head), one tile a warp) and key parts (batch 1) do not pair.
        assert!(!plan(256, 12, 16, 8).paired());
        assert!(!plan(1, 6, 100, 8).paired());
        let split = plan(8, 3, 100, 1);
        assert_eq!(split.grid.0, 2);
        assert!(!split.paired());
        // The knob: 0 never pairs, 8 pairs every unsplit block whose warps hold two tiles.
        let knobs = |pair_max_warps| PlanKnobs {
            pair_max_warps,
            pairq_min_pairs_per_sm: usize::MAX,
            pairq_min_warps: usize::MAX,
            ..PlanKnobs::default()
        };
        assert!(!resident_plan(256, 12, 113, 64, H100, knobs(0))
            .unwrap()
            .paired());
        let all = resident_plan(256, 12, 197, 64, H100, knobs(8)).unwrap();
        assert!(all.paired() && !all.stages_q());
        assert_eq!(all.kernel, ResidentKernel::Paired);
        assert_eq!(plan135(256, 12, 197).kernel, ResidentKernel::R80);
        assert_eq!(plan135(256, 12, 159).kernel, ResidentKernel::R96);
    }

    #[test]
    fn many_pairs_stage_q_in_shared_memory() {
        // Lever 136's measured cells: 6 and 12 heads at batch 256 (11.6 and 23.3 pairs a SM),
        // every keep from 1.0 (197 tokens, 7-warp blocks) to 0.3 (69, 3 warps), take the form
        // that stages Q, with Q's rows in the launch's shared memory (half as much again as K
        // and V, within the opt-in even at the longest sequence).
        for heads in [6, 12] {
            for max_len in [197, 159, 113, 69, 256] {
                let p = plan(256, heads, max_len, 8);
                assert!(p.paired() && p.stages_q() && !p.low_registers(), "{p:?}");
                assert_eq!(p.kernel, ResidentKernel::PairedStagedQ);
                assert_eq!(p.grid.0, 1);
                let kv = resident_smem_bytes(max_len, 64);
                assert_eq!(p.shared_mem_bytes as usize, kv * 3 / 2);
                assert!(p.shared_mem_bytes as usize <= resident_opt_in_bytes(64));
            }
        }
        // Batch 64 (384 and 768 pairs) and 3 heads at batch 256 (768): blocks of 3 and 4 warps
        // keep lever 135's rule; blocks of 5 and 7 warps stage Q (lever 138), except 384 blocks
        // of 7 warps, which the SMs hold at once on the 80-register kernel (three a SM) and not
        // staged (two).
        for (batch, heads) in [(64, 6), (64, 12), (256, 3)] {
            for max_len in [113, 69] {
                let p = plan(batch, heads, max_len, 8);
                assert!(!p.stages_q(), "{p:?}");
                assert_eq!(p, plan135(batch, heads, max_len));
            }
            assert!(plan(batch, heads, 159, 8).stages_q());
            let long = plan(batch, heads, 197, 8);
            assert_eq!(long.stages_q(), batch * heads != 384, "{long:?}");
            if !long.stages_q() {
                assert_eq!(long, plan135(batch, heads, 197));
            }
        }
        // The threshold: 8 pairs a SM (1,056 on 132 SMs), for blocks of under 5 warps.
        assert!(plan(88, 12, 113, 8).stages_q());
        assert!(!plan(87, 12, 113, 8).stages_q());
        // The warps' knob: 9 turns lever 138 off.
        let no_warps = PlanKnobs {
            pairq_min_warps: 9,
            ..PlanKnobs::default()
        };
        let p = resident_plan(64, 12, 197, 64, H100, no_warps).unwrap();
        assert_eq!(p, plan135(64, 12, 197));
        // Key parts, splits and blocks without a two-tile warp never stage Q.
        assert!(!plan(1, 12, 197, 8).stages_q());
        assert!(!plan(1024, 12, 16, 8).stages_q());
        // The knob at 0: every unsplit block with a two-tile warp, but not a grid the SMs hold at
        // once unpaired and not staged: 384 blocks of 7 warps fit at three a SM on the
        // 80-register kernel, at two staged (lever 136: 0.86× there).
        let every = PlanKnobs {
            pairq_min_pairs_per_sm: 0,
            ..PlanKnobs::default()
        };
        let at =
            |batch, heads, max_len| resident_plan(batch, heads, max_len, 64, H100, every).unwrap();
        assert!(at(64, 12, 197).stages_q() && at(64, 6, 159).stages_q());
        assert!(!at(64, 6, 197).stages_q());
        assert!(!at(64, 3, 197).stages_q(), "split: a tile per warp");
    }

    /// GPUs with less shared memory a block than the H100 get plans within it: the A100 (163 KB,
    /// 164 a SM), compute capability 8.6 / 8.9 (99 KB, 100 a SM: no Q staging past 224 tokens,
    /// four key parts where eight do not fit) and a 64 KB limit (no resident kernel past 224
    /// tokens at head_dim 64).
    #[test]
    fn smaller_gpus_get_plans_within_their_limits() {
        let a100 = GpuLimits {
            sm_count: 108,
            smem_per_sm: 164 * 1024,
            smem_per_block: 163 * 1024,
        };
        let ada = GpuLimits {
            sm_count: 128,
            smem_per_sm: 100 * 1024,
            smem_per_block: 99 * 1024,
        };
        let small = GpuLimits {
            smem_per_block: 64 * 1024,
            ..ada
        };
        let knobs = PlanKnobs::default();
        for gpu in [H100, a100, ada, small] {
            for head_dim in [32, 64] {
                for batch in [1, 8, 64, 256, 1024] {
                    for heads in [3, 6, 12] {
                        for max_len in [1, 17, 64, 113, 176, 177, 197, 224, 225, 256] {
                            let what = format!(
                                "{gpu:?} batch {batch} heads {heads} len {max_len} d {head_dim}"
                            );
                            let kv = resident_smem_bytes(max_len, head_dim);
                            match resident_plan(batch, heads, max_len, head_dim, gpu, knobs) {
                                Some(p) => {
                                    assert!(
                                        p.shared_mem_bytes as usize <= gpu.smem_per_block,
                                        "{what}: {p:?}"
                                    );
                                    assert!(
                                        p.shared_mem_bytes as usize
                                            <= resident_opt_in_bytes(head_dim),
                                        "{what}"
                                    );
                                }
                                None => assert!(kv > gpu.smem_per_block, "{what}"),
                            }
                        }
                    }
                }
            }
        }
        // 99 KB: K, V and Q of 224 tokens (94.5 KB) fit, of 225 (101.25 KB) not; key parts at
        // batch 1 fall back from eight (103.5 KB at 256 tokens) to four (99 KB).
        let staged = |gpu, max_len| {
            resident_plan(256, 12, max_len, 64, gpu, knobs)
                .unwrap()
                .stages_q()
        };
        assert!(staged(ada, 224) && !staged(ada, 225) && staged(H100, 256));
        let parts = |gpu| resident_plan(1, 3, 256, 64, gpu, knobs).unwrap().block.1;
        assert_eq!((parts(H100), parts(ada)), (8, 4));
        // 64 KB: 224 tokens' K and V (63 KB) fit, 225 tokens' (65.25 KB) do not.
        assert!(resident_plan(8, 6, 224, 64, small, knobs).is_some());
        assert!(resident_plan(8, 6, 225, 64, small, knobs).is_none());
    }

    /// `CANDLE_RAGGED_GPU_SMEM_KB`'s cap: a smaller GPU's limits, never larger ones, and no
    /// change for a missing or unreadable value.
    #[test]
    fn a_cap_lowers_the_limits_never_raises_them() {
        let h100 = GpuLimits {
            sm_count: 132,
            smem_per_sm: 228 * 1024,
            smem_per_block: 227 * 1024,
        };
        let capped = h100.capped_kb(Some("99"));
        assert_eq!(capped.smem_per_block, 99 * 1024);
        assert_eq!(capped.smem_per_sm, 100 * 1024);
        assert_eq!(capped.sm_count, 132);
        assert_eq!(h100.capped_kb(Some(" 500 ")), h100);
        assert_eq!(h100.capped_kb(None), h100);
        assert_eq!(h100.capped_kb(Some("lots")), h100);
    }

    /// For every batch the kernel takes: every query tile of the longest sequence has a warp,
    /// the parts never outnumber the key tiles, and the shared memory stays within what the
    /// kernels opt into when they load (and under the H100's 227 KB per block).
    #[test]
    fn every_plan_covers_its_tiles_within_the_opt_in() {
        for head_dim in [32, 64] {
            let opt_in = resident_opt_in_bytes(head_dim);
            assert!(opt_in <= 227 * 1024, "opt-in {opt_in} bytes");
            // Key parts; lever 137's threshold and lever 138's warps, default, always or never.
            for (max_parts, pairq_min_pairs_per_sm, pairq_min_warps) in [
                (1, 8, 5),
                (4, 8, 5),
                (8, 8, 5),
                (8, 0, 5),
                (8, usize::MAX, 9),
            ] {
                for batch in [1, 2, 3, 8, 64, 256, 1024] {
                    for heads in [1, 3, 6, 12, 16] {
                        for max_len in [1, 2, 15, 16, 17, 63, 64, 65, 129, 197, 255, 256] {
                            let knobs = PlanKnobs {
                                max_parts,
                                pairq_min_pairs_per_sm,
                                pairq_min_warps,
                                ..PlanKnobs::default()
                            };
                            let p = resident_plan(batch, heads, max_len, head_dim, H100, knobs)
                                .unwrap();
                            let q_tiles = max_len.div_ceil(16) as u32;
                            let (warps, parts) = (p.block.0 / 32, p.block.1);
                            assert!((1..=RESIDENT_MAX_WARPS as u32).contains(&(warps * parts)));
                            assert!(parts as usize <= max_parts);
                            let what = format!("batch {batch} heads {heads} len {max_len} d {head_dim} max {max_parts}: {p:?}");
                            if parts > 1 {
                                assert!(p.grid.0 * warps >= q_tiles, "{what}");
                                assert!(parts <= q_tiles, "{what}");
                            } else {
                                // Tiles warp, warp + warps · splits, ...: all reached.
                                assert!(p.grid.0 >= 1 && p.grid.0 <= 2, "{what}");
                                // The paired kernel: one block per (sequence, head), at most
                                // two tiles a warp.
                                if p.paired() {
                                    assert_eq!(p.grid.0, 1, "{what}");
                                    assert!(q_tiles > warps && q_tiles <= 2 * warps, "{what}");
                                }
                            }
                            assert!(!(p.paired() && p.low_registers()), "{what}");
                            assert!(p.paired() || !p.stages_q(), "{what}");
                            assert_eq!((p.grid.1, p.grid.2), (heads as u32, batch as u32));
                            assert!(p.shared_mem_bytes as usize <= opt_in, "{what}");
                        }
                    }
                }
            }
        }
    }
}
