//! Compiles `kernels/fastpath.cu` (exact GELU, LayerNorm) to PTX with nvcc when the `cuda` feature
//! is on. No fast-math: both must match the CPU path to rounding.
//! With compute capability 9.0 and the CUTLASS headers (`CUTLASS_HOME`, set by
//! scripts/install-cuda-toolkit.sh), `kernels/cutlass_linear.cu` (fc1 with the exact GELU in its
//! epilogue) is also compiled for sm_90a into a static library and `cfg(fastpath_cutlass)` is set;
//! with compute capability 9.0, `kernels/thin_gemm_sm90.cu` (the thin GEMM on TMA and wgmma,
//! lever 100) becomes a compute_90a PTX module of its own and `cfg(fastpath_thin_gemm)` is set.
//! The CPU build needs no CUDA at all: without the feature this script does nothing.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels/fastpath.cu");
    println!("cargo:rerun-if-changed=kernels/gelu_phi.cuh");
    println!("cargo:rerun-if-changed=kernels/small_block.cu");
    println!("cargo:rerun-if-changed=kernels/thin_gemm_sm90.cu");
    println!("cargo:rerun-if-changed=kernels/epilogue.cuh");
    println!("cargo:rerun-if-changed=kernels/layer_norm_row.cuh");
    println!("cargo:rerun-if-changed=kernels/cluster_exchange.cuh");
    println!("cargo:rerun-if-changed=kernels/dependent_launch.cuh");
    println!("cargo::rustc-check-cfg=cfg(fastpath_thin_gemm)");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=DEP_CANDLE_RAGGED_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-changed=kernels/cutlass_linear.cu");
    println!("cargo:rerun-if-env-changed=CUTLASS_HOME");
    println!("cargo::rustc-check-cfg=cfg(fastpath_cutlass)");
    println!("cargo::rustc-check-cfg=cfg(fastpath_dependent_launch)");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    // bf16 arithmetic needs compute capability 8.0; the GPU machines are 9.0.
    let cap = compute_cap();
    if cap < 80 {
        panic!("candle-fastpath needs CUDA_COMPUTE_CAP >= 80 (bf16 arithmetic), got {cap}");
    }
    let nvcc = std::env::var("NVCC")
        .map(PathBuf::from)
        .unwrap_or_else(|_| match cuda_home() {
            Some(home) => home.join("bin").join("nvcc"),
            None => PathBuf::from("nvcc"),
        });
    // fastpath.cu: GELU, LayerNorm, patchify, embedding, the pruner head; small_block.cu: a
    // whole ViT block in one launch for small token counts (its own module: a change there
    // leaves the other kernels' PTX untouched).
    // candle-ragged's kernel folder (its `links` metadata): attention_warp.cuh, row_norm.cuh.
    let ragged_include = std::env::var("DEP_CANDLE_RAGGED_INCLUDE")
        .expect("candle-ragged publishes its kernel folder (links metadata `include`)");
    println!("cargo:rerun-if-changed={ragged_include}/attention_warp.cuh");
    println!("cargo:rerun-if-changed={ragged_include}/convert_f32.cuh");
    println!("cargo:rerun-if-changed={ragged_include}/attention_common.cuh");
    println!("cargo:rerun-if-changed={ragged_include}/row_norm.cuh");
    println!("cargo:rerun-if-changed={ragged_include}/select_common.cuh");
    println!("cargo:rerun-if-changed={ragged_include}/wgmma_common.cuh");
    for name in ["fastpath", "small_block"] {
        let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-I{ragged_include}"))
            .arg(format!("-arch=compute_{cap}"))
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
    if cap >= 90 {
        // thin_gemm_sm90.cu: TMA + wgmma, compute_90a only (loaded on compute capability 9.0).
        let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("thin_gemm.ptx");
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "-arch=compute_90a"])
            .arg(format!("-I{ragged_include}"))
            .arg("-o")
            .arg(&out)
            .arg("kernels/thin_gemm_sm90.cu")
            .status()
            .expect("nvcc ran for fastpath.cu above");
        if !status.success() {
            panic!("nvcc failed to compile kernels/thin_gemm_sm90.cu ({status})");
        }
        println!("cargo:rustc-cfg=fastpath_thin_gemm");
        // fastpath.cu's PTX was compiled for 9.0 too, so its kernels' `griddepcontrol.wait`
        // (dependent_launch.cuh) is in it: they may get programmatic graph edges.
        println!("cargo:rustc-cfg=fastpath_dependent_launch");
        build_cutlass(&nvcc);
    }
}

/// The CUDA toolkit: `CUDA_HOME`, else `CUDA_PATH`.
fn cuda_home() -> Option<PathBuf> {
    std::env::var_os("CUDA_HOME")
        .or_else(|| std::env::var_os("CUDA_PATH"))
        .map(PathBuf::from)
}

/// The CUTLASS source tree (`include/` and `tools/util/include/`): `CUTLASS_HOME`, else where
/// scripts/install-cuda-toolkit.sh puts it next to the toolkit.
fn cutlass_home() -> Option<PathBuf> {
    std::env::var_os("CUTLASS_HOME")
        .map(PathBuf::from)
        .into_iter()
        .chain(cuda_home().map(|h| h.join("../../cutlass_library/source")))
        .find(|p| p.join("include/cutlass/cutlass.h").exists())
}

fn build_cutlass(nvcc: &PathBuf) {
    let Some(cutlass) = cutlass_home() else {
        println!(
            "cargo:warning=candle-fastpath: CUTLASS headers not found (CUTLASS_HOME); fc1 keeps \
             cuBLASLt and the separate GELU kernel"
        );
        return;
    };
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let obj = out_dir.join("cutlass_linear.o");
    let status = Command::new(nvcc)
        .args([
            "-c",
            "-O3",
            "-std=c++17",
            "-arch=sm_90a",
            "--expt-relaxed-constexpr",
        ])
        .args(["-DNDEBUG", "-Xcompiler", "-fPIC", "-w"])
        .arg(format!("-I{}", cutlass.join("include").display()))
        .arg(format!(
            "-I{}",
            cutlass.join("tools/util/include").display()
        ))
        .arg("-o")
        .arg(&obj)
        .arg("kernels/cutlass_linear.cu")
        .status()
        .expect("cannot run nvcc");
    if !status.success() {
        panic!("nvcc failed to compile kernels/cutlass_linear.cu ({status})");
    }
    let lib = out_dir.join("libfastpath_cutlass.a");
    let _ = std::fs::remove_file(&lib);
    let status = Command::new("ar")
        .arg("crs")
        .arg(&lib)
        .arg(&obj)
        .status()
        .expect("cannot run ar");
    if !status.success() {
        panic!("ar failed to archive cutlass_linear.o ({status})");
    }
    // The CUTLASS host code launches through the CUDA runtime; link it statically so the
    // binaries need no libcudart at run time (it loads the driver's libcuda itself).
    let cuda_home = cuda_home().unwrap_or_else(|| PathBuf::from("/usr/local/cuda"));
    for dir in ["lib64", "lib"] {
        println!(
            "cargo:rustc-link-search=native={}",
            cuda_home.join(dir).display()
        );
    }
    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!("cargo:rustc-link-lib=static=fastpath_cutlass");
    println!("cargo:rustc-link-lib=static=cudart_static");
    for l in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    println!("cargo:rustc-cfg=fastpath_cutlass");
}

/// The compute capability to build the PTX for: candle-ragged's (its build script chose it from
/// `CUDA_COMPUTE_CAP` or the machine's GPU, as candle's own kernels do, and passes it on through
/// its `links` key), so that the two crates' kernels load on the same GPU.
fn compute_cap() -> u32 {
    std::env::var("DEP_CANDLE_RAGGED_COMPUTE_CAP")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(80)
}
