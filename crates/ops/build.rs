//! With the `cuda` feature, compiles `kernels/*.cu` to PTX with the nvcc on PATH (pinned to
//! 13.0 by ../shared/gpu/build-cuda.sh: the driver refuses PTX from a newer nvcc). The CPU
//! build compiles nothing.

fn main() {
    let kernels = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels");
    println!("cargo::rerun-if-changed={}", kernels.display());
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let compile = |name: &str, arch: &str| {
        let src = kernels.join(format!("{name}.cu"));
        let status = std::process::Command::new("nvcc")
            .args(["--ptx", "-O3", &format!("-arch={arch}"), "-o"])
            .arg(out.join(format!("{name}.ptx")))
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("running nvcc for {}: {e}", src.display()));
        assert!(status.success(), "nvcc failed on {}", src.display());
    };
    for name in [
        "decoder",
        "flash_attention",
        "fused",
        "kv_cache",
        "layer_norm",
        "merge",
        "paged_attention",
        "patch_embed",
        "row_copy",
        "sampling",
        "skinny",
        "token_mask",
    ] {
        compile(name, &format!("compute_{cap}"));
    }
    // Hopper's warp-group MMA exists only in the architecture-specific target (sm_90a); the
    // runtime loads these modules on compute capability 9.0 devices alone.
    compile("flash_wgmma", "compute_90a");
    compile("gemm_wgmma", "compute_90a");
}
