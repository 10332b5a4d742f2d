//! `scripts/compute-cap.sh`, which picks the compute capability the CUDA build targets (exported
//! by `install-cuda-toolkit.sh`): the caller's `CUDA_COMPUTE_CAP`, else the lowest one a
//! (stand-in) `nvidia-smi` lists, else 90.

use std::path::Path;
use std::process::Command;

/// Runs the script with `PATH` = `bin` + the system's, and `CUDA_COMPUTE_CAP` as given.
fn compute_cap(bin: &Path, env_cap: Option<&str>) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/compute-cap.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(script)
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env_remove("CUDA_COMPUTE_CAP");
    if let Some(cap) = env_cap {
        cmd.env("CUDA_COMPUTE_CAP", cap);
    }
    let out = cmd.output().expect("bash runs");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A folder holding an `nvidia-smi` that prints `body` (a shell script's lines).
fn stand_in(body: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let smi = dir.path().join("nvidia-smi");
    std::fs::write(&smi, format!("#!/bin/sh\n{body}\n")).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    dir
}

#[test]
#[cfg(unix)]
fn the_lowest_gpu_of_the_machine_unless_the_caller_says() {
    // Two GPUs: the build must load on both, so the lower one.
    let two = stand_in("echo 12.0\necho 8.9");
    assert_eq!(compute_cap(two.path(), None), "89");
    // The caller's value wins.
    assert_eq!(compute_cap(two.path(), Some("80")), "80");
    // One H100.
    let h100 = stand_in("echo 9.0");
    assert_eq!(compute_cap(h100.path(), None), "90");
    // nvidia-smi present but failing (no driver), or printing nothing usable: the default.
    let failing = stand_in("echo 'NVIDIA-SMI has failed' >&2\nexit 9");
    assert_eq!(compute_cap(failing.path(), None), "90");
    let garbage = stand_in("echo '[N/A]'");
    assert_eq!(compute_cap(garbage.path(), None), "90");
    // No nvidia-smi at all (an empty folder first on PATH; the build machines have none).
    let none = tempfile::tempdir().unwrap();
    if Command::new("sh")
        .args(["-c", "command -v nvidia-smi"])
        .env("PATH", "/usr/bin:/bin")
        .output()
        .map(|o| !o.status.success())
        .unwrap_or(true)
    {
        assert_eq!(compute_cap(none.path(), None), "90");
    }
}
