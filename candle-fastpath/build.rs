//! Compiles `kernels/fastpath.cu` (exact GELU, LayerNorm) to PTX with nvcc when the `cuda` feature
//! is on. No fast-math: both must match the CPU path to rounding.
//! The CPU build needs no CUDA at all: without the feature this script does nothing.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels/fastpath.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    // bf16 arithmetic needs compute capability 8.0; the GPU machines are 9.0.
    let cap: u32 = std::env::var("CUDA_COMPUTE_CAP")
        .ok()
        .and_then(|s| s.trim().replace('.', "").parse().ok())
        .unwrap_or(80);
    if cap < 80 {
        panic!("candle-fastpath needs CUDA_COMPUTE_CAP >= 80 (bf16 arithmetic), got {cap}");
    }
    let nvcc = std::env::var("NVCC")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            match std::env::var("CUDA_HOME").or_else(|_| std::env::var("CUDA_PATH")) {
                Ok(home) => PathBuf::from(home).join("bin").join("nvcc"),
                Err(_) => PathBuf::from("nvcc"),
            }
        });
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("fastpath.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(&out)
        .arg("kernels/fastpath.cu")
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run nvcc ({}): {e}; install a toolkit with scripts/install-cuda-toolkit.sh",
                nvcc.display()
            )
        });
    if !status.success() {
        panic!("nvcc failed to compile kernels/fastpath.cu ({status})");
    }
}
