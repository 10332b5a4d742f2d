//! Compiles `kernels/ragged_attention.cu` to PTX with nvcc when the `cuda` feature is on.
//! The CPU build needs no CUDA at all: without the feature this script does nothing but publish
//! the kernel folder (`links` metadata `include`, `DEP_CANDLE_RAGGED_INCLUDE` in dependents'
//! build scripts), so that other crates' kernels can include `attention_warp.cuh`.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    // The kernel folder by its absolute path, in the include metadata and in the rerun checks
    // alike: a target folder shared with another checkout (a worktree) then reruns this script
    // for this one, instead of keeping the other's `include` (whose files cargo would otherwise
    // check here, by their relative names, and find fresh).
    let kernels = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("kernels");
    println!("cargo:rerun-if-changed=build.rs");
    for file in [
        "ragged_attention.cu",
        "ragged_attention_sm90.cu",
        "attention_common.cuh",
        "attention_warp.cuh",
        "convert_f32.cuh",
        "row_norm.cuh",
        "select_common.cuh",
        "wgmma_common.cuh",
    ] {
        println!("cargo:rerun-if-changed={}", kernels.join(file).display());
    }
    println!("cargo::rustc-check-cfg=cfg(ragged_wgmma)");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:include={}", kernels.display());
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    // mma.sync m16n8k16 with bf16 needs compute capability 8.0; the GPU machines are 9.0.
    let cap = compute_cap();
    if cap < 80 {
        panic!(
            "candle-ragged needs CUDA_COMPUTE_CAP >= 80 (tensor-core mma for f16/bf16), got {cap}"
        );
    }
    // Dependents' build scripts read it as DEP_CANDLE_RAGGED_COMPUTE_CAP (candle-fastpath builds
    // its kernels for the same GPU).
    println!("cargo:compute_cap={cap}");
    let nvcc = std::env::var("NVCC")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            match std::env::var("CUDA_HOME").or_else(|_| std::env::var("CUDA_PATH")) {
                Ok(home) => PathBuf::from(home).join("bin").join("nvcc"),
                Err(_) => PathBuf::from("nvcc"),
            }
        });
    compile_ptx(&nvcc, &format!("compute_{cap}"), "ragged_attention");
    // The warpgroup-MMA kernel exists only for compute_90a (Hopper); cfg(ragged_wgmma) tells
    // src/cuda.rs that its PTX is there.
    if cap >= 90 {
        compile_ptx(&nvcc, "compute_90a", "ragged_attention_sm90");
        println!("cargo:rustc-cfg=ragged_wgmma");
    }
}

/// `kernels/NAME.cu` to `$OUT_DIR/NAME.ptx` for the virtual architecture `arch`.
fn compile_ptx(nvcc: &PathBuf, arch: &str, name: &str) {
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join(format!("{name}.ptx"));
    let status = Command::new(nvcc)
        .args(["--ptx", "-O3", "-std=c++17", "--use_fast_math"])
        .arg(format!("-arch={arch}"))
        .arg("-o")
        .arg(&out)
        .arg(format!("kernels/{name}.cu"))
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run nvcc ({}): {e}; install a toolkit with scripts/install-cuda-toolkit.sh",
                nvcc.display()
            )
        });
    if !status.success() {
        panic!("nvcc failed to compile kernels/{name}.cu ({status})");
    }
}

/// The compute capability to build the PTX for, as candle's own kernels choose it (candle-kernels'
/// build asks cudaforge too, so both sets of kernels load on the same GPU): `CUDA_COMPUTE_CAP`
/// ("90", "9.0", "90a"), else the first GPU `nvidia-smi` lists, else 8.0 (a machine without a
/// GPU building for another: set `CUDA_COMPUTE_CAP` to that GPU's).
#[cfg(feature = "cuda")]
fn compute_cap() -> u32 {
    cudaforge::detect_compute_cap()
        .map(|arch| arch.base() as u32)
        .unwrap_or(80)
}

#[cfg(not(feature = "cuda"))]
fn compute_cap() -> u32 {
    80
}
