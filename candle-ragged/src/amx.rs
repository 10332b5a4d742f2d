//! Intel AMX (Sapphire Rapids and later: `amx-tile` + `amx-bf16`) for the CPU kernels: whether
//! this process can use the tiles, the bf16 *pair panel* layout their second operand is read in,
//! and one block of a bf16 product (two 16-row tiles × two 16-column panels, f32 sums).
//!
//! The ragged attention's bf16 CPU path ([`crate::ragged_attention`]) runs its two products on
//! these tiles; `candle-fastpath`'s bf16 `FusedLinear` runs its weights' products on them too,
//! which is why the module is public (hidden from the docs: it is a building block, not this
//! crate's API, and its functions are `unsafe` where the tiles read through raw pointers).
//!
//! One `tdpbf16ps` multiplies a 16 × 32 bf16 tile by a 32 × 16 one into 16 × 16 f32 sums
//! (8,192 multiply-adds an instruction against AVX-512's 16). Each product of two bf16 values is
//! exact in f32; the hardware adds them into the f32 accumulator pair by pair with denormals
//! flushed, so a sum can differ from an ordered chain of fused multiply-adds by the rounding of
//! the additions.

use std::sync::OnceLock;

/// Rows of a tile (of the left operand and of an accumulator).
pub const TILE_ROWS: usize = 16;

/// Columns of a panel: one accumulator tile's 16 f32 a row.
pub const COLS: usize = 16;

/// Terms of the sum a tile step covers: a 16 × 32 bf16 tile of the left operand, 64 bytes a
/// row.
pub const STEP: usize = 32;

/// Whether the CPU has AMX-TILE and AMX-BF16 and Linux lets this process use the tile data
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once a process). Callers add their own switch.
pub fn usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| cpu_has_amx_bf16() && request_tile_data())
}

/// CPUID leaf 7: EDX bit 22 (AMX-BF16) and bit 24 (AMX-TILE).
fn cpu_has_amx_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid_count;
        // Leaf 7 is read only where the maximum leaf reaches it.
        let (max, leaf7) = (__cpuid_count(0, 0).eax, __cpuid_count(7, 0));
        max >= 7 && leaf7.edx & (1 << 22) != 0 && leaf7.edx & (1 << 24) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Asks Linux for the AMX tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`),
/// without which the first tile instruction faults; true when granted.
fn request_tile_data() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        const SYS_ARCH_PRCTL: usize = 158;
        const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
        const XFEATURE_XTILEDATA: usize = 18;
        let ret: isize;
        // SAFETY: arch_prctl with this request only changes the process's permitted XSAVE
        // features; the syscall clobbers rcx and r11, declared, and touches no memory of ours.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret == 0
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    false
}

/// A depth (terms of each sum) padded to a whole number of tile steps.
pub fn padded_depth(k: usize) -> usize {
    k.next_multiple_of(STEP)
}

/// Where term `i` of column `c` sits in a pair panel (the layout `tdpbf16ps` reads its second
/// operand in): row `i / 2` of the panel holds, for each of its 16 columns, terms `i` and
/// `i + 1` side by side, so a panel's 32-term block is one 1 KB tile load.
#[inline(always)]
pub fn place(i: usize, c: usize) -> usize {
    (i / 2) * 2 * COLS + 2 * c + i % 2
}

/// The tile configuration `ldtilecfg` reads (palette 1), the same for every product here: tiles
/// 0–3 the accumulators (16 rows of 16 f32), 4–5 the left operand's row tiles (16 rows of 32
/// bf16), 6–7 the panels' blocks (16 rows of 16 pairs).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1; // palette 1
        for t in 0..8 {
            // colsb[t] (u16 at 16 + 2t): 64 bytes a row for every tile here.
            c[16 + 2 * t] = 64;
            // rows[t] (u8 at 48 + t).
            c[48 + t] = TILE_ROWS as u8;
        }
        Self(c)
    }
}

/// The tiles configured on this thread for [`Tiles::block`]; released when dropped (not `Send`:
/// the configuration belongs to the thread).
pub struct Tiles(std::marker::PhantomData<*const ()>);

impl Tiles {
    /// Configures the tiles on this thread.
    ///
    /// # Safety
    /// [`usable`] is true.
    pub unsafe fn configure() -> Self {
        let cfg = TileConfig::new();
        // SAFETY: AMX is usable (the caller's); ldtilecfg reads the 64 bytes of `cfg`.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
        }
        let _ = cfg;
        Self(std::marker::PhantomData)
    }

    /// One block of a product: `c[r][j] = Σ_i a[r][i] · b[i][j]` over `steps` tile steps
    /// (`32 · steps` terms) for the 16 rows at `a` (`a_rs` bytes apart; 32 more when
    /// `two_tiles`, from `a + 16 · a_rs`) and the 16 columns of the pair panel block at `b0`
    /// (16 more from `b1`), stored as f32 at `c` (`c_rs` bytes apart: 16 or 32 rows of 32
    /// values; the columns from `b1` at `c + 16`).
    ///
    /// # Safety
    /// Each of `a`'s 16 (32) rows holds `32 · steps` readable bf16 values; `b0` and `b1` are
    /// pair panel blocks of `32 · steps` terms (`512 · steps` values, contiguous); `c` has room
    /// for 16 (32) rows of 32 f32.
    #[allow(clippy::too_many_arguments)]
    #[cfg(target_arch = "x86_64")]
    pub unsafe fn block(
        &self,
        a: *const half::bf16,
        a_rs: usize,
        two_tiles: bool,
        b0: *const half::bf16,
        b1: *const half::bf16,
        steps: usize,
        c: *mut f32,
        c_rs: usize,
    ) {
        use std::arch::asm;
        let b_rs = 2 * COLS * 2;
        // SAFETY: the tiles are configured (self); every load reads 16 rows of 64 bytes inside
        // the operands and every store writes 16 rows of 64 bytes inside `c` (the caller's).
        unsafe {
            asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
            if two_tiles {
                asm!("tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
            }
            for s in 0..steps {
                let (ak, bk) = (a.add(s * STEP), s * STEP * COLS);
                asm!(
                    "tileloadd tmm4, [{a} + {a_rs}*1]",
                    "tileloadd tmm6, [{b0} + {b_rs}*1]",
                    "tileloadd tmm7, [{b1} + {b_rs}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    a = in(reg) ak,
                    a_rs = in(reg) a_rs,
                    b0 = in(reg) b0.add(bk),
                    b1 = in(reg) b1.add(bk),
                    b_rs = in(reg) b_rs,
                    options(nostack, readonly),
                );
                if two_tiles {
                    asm!(
                        "tileloadd tmm5, [{a} + {a_rs}*1]",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a = in(reg) ak.byte_add(TILE_ROWS * a_rs),
                        a_rs = in(reg) a_rs,
                        options(nostack, readonly),
                    );
                }
            }
            asm!(
                "tilestored [{c0} + {c_rs}*1], tmm0",
                "tilestored [{c1} + {c_rs}*1], tmm1",
                c0 = in(reg) c,
                c1 = in(reg) c.add(COLS),
                c_rs = in(reg) c_rs,
                options(nostack),
            );
            if two_tiles {
                let c = c.byte_add(TILE_ROWS * c_rs);
                asm!(
                    "tilestored [{c0} + {c_rs}*1], tmm2",
                    "tilestored [{c1} + {c_rs}*1], tmm3",
                    c0 = in(reg) c,
                    c1 = in(reg) c.add(COLS),
                    c_rs = in(reg) c_rs,
                    options(nostack),
                );
            }
        }
    }

    /// Not x86-64: never made ([`usable`] is false).
    ///
    /// # Safety
    /// None needed: unreachable.
    #[allow(clippy::too_many_arguments)]
    #[cfg(not(target_arch = "x86_64"))]
    pub unsafe fn block(
        &self,
        _: *const half::bf16,
        _: usize,
        _: bool,
        _: *const half::bf16,
        _: *const half::bf16,
        _: usize,
        _: *mut f32,
        _: usize,
    ) {
        unreachable!("AMX tiles are configured only where usable() is true")
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured on this thread (Tiles is neither Send nor made
        // elsewhere); tilerelease returns them to the init state.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem));
        }
    }
}
