//! Compiles EVERY kernel family of the registry with NVRTC to a CUBIN for sm_90a (H100/H200),
//! no GPU needed, and checks the CUBIN cache. Part of the README test command: CI installs
//! nvidia-cuda-nvrtc==13.0.88 into target/pyenv and points DSV4_CUDA_LIB_DIR at its lib
//! directory instead of putting it on LD_LIBRARY_PATH (scripts/test.sh), so this also checks
//! that the library finds NVRTC by itself (src/cuda/libs.rs).
//!
//! DSV4_DUMP_CUBIN_DIR=<dir> writes each family's CUBIN there (for cuobjdump / nvdisasm).
//!
//! Without NVRTC this prints `skipped: NVRTC (libnvrtc.so.13) not found ...` (with every place
//! searched) and passes, except when the environment variable CI is set: there a missing NVRTC
//! is a failure.

mod common;

use common::TempDir;
use dsv4::Status;
use dsv4::cuda::libs::{CudaLib, LIB_DIR_ENV, loaded};
use dsv4::cuda::registry::{
    KernelCache, KernelFn, KernelSource, cubin_defines, families, nvrtc_version,
};
use dsv4::cuda::{CacheOutcome, arch_for};

const ARCH: &str = "sm_90a";

fn nvrtc_or_skip() -> bool {
    match nvrtc_version() {
        Ok((major, minor)) => {
            let lib = loaded(CudaLib::Nvrtc).expect("loaded by nvrtc_version");
            println!(
                "NVRTC {major}.{minor}: {} [{}]",
                lib.path.display(),
                lib.source
            );
            true
        }
        Err(e) => {
            if std::env::var_os("CI").is_some() {
                panic!("CI is set, so NVRTC must be installed (scripts/test.sh does it): {e}");
            }
            println!("skipped: {e}");
            false
        }
    }
}

/// ELF machine number of NVIDIA CUDA objects.
const EM_CUDA: u16 = 190;

/// With DSV4_CUDA_LIB_DIR set (scripts/test.sh sets it; NVRTC is not on LD_LIBRARY_PATH),
/// NVRTC must come from there: the end-to-end check of src/cuda/libs.rs.
#[test]
fn nvrtc_comes_from_dsv4_cuda_lib_dir_when_set() {
    let Some(dirs) = std::env::var_os(LIB_DIR_ENV).filter(|d| !d.is_empty()) else {
        println!("skipped: {LIB_DIR_ENV} not set");
        return;
    };
    if !nvrtc_or_skip() {
        return;
    }
    let lib = loaded(CudaLib::Nvrtc).unwrap();
    let real = |p: &std::path::Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let file = real(&lib.path);
    assert!(
        std::env::split_paths(&dirs).any(|d| file.starts_with(real(&d))),
        "NVRTC was loaded from {} [{}], not from {LIB_DIR_ENV}={}",
        lib.path.display(),
        lib.source,
        dirs.to_string_lossy()
    );
    assert_eq!(lib.source, LIB_DIR_ENV);
}

#[test]
fn every_family_compiles_to_cubin_for_sm_90a() {
    if !nvrtc_or_skip() {
        return;
    }
    assert_eq!(arch_for(9, 0), ARCH);
    assert!(!families().is_empty());
    let mut failures = Vec::new();
    for fam in families() {
        let t = std::time::Instant::now();
        match fam.compile(ARCH) {
            Ok(cubin) => {
                assert!(
                    cubin.starts_with(b"\x7fELF"),
                    "{}: not an ELF image",
                    fam.family
                );
                let machine = u16::from_le_bytes([cubin[18], cubin[19]]);
                assert_eq!(
                    machine, EM_CUDA,
                    "{}: ELF machine {machine}, not CUDA",
                    fam.family
                );
                common::gpu::assert_cubin_defines(fam, &cubin);
                if let Some(d) = std::env::var_os("DSV4_DUMP_CUBIN_DIR") {
                    // For inspection with cuobjdump / nvdisasm on a machine that has them.
                    let path =
                        std::path::Path::new(&d).join(format!("{}-{ARCH}.cubin", fam.family));
                    std::fs::write(&path, &cubin).unwrap();
                }
                println!(
                    "compiled {:<12} for {ARCH}: {:>8} bytes CUBIN, {} entry points, {:.2} s",
                    fam.family,
                    cubin.len(),
                    fam.functions.len(),
                    t.elapsed().as_secs_f64()
                );
            }
            Err(e) => failures.push(format!("{}: {e}", fam.family)),
        }
    }
    assert!(
        failures.is_empty(),
        "kernel families failed to compile:\n{}",
        failures.join("\n\n")
    );
}

/// The fast set's wgmma kernels must keep their wgmmas asynchronous: ptxas serialises them (info
/// C7511, "wgmma.mma_async instructions are serialized") when it cannot keep the accumulator
/// registers in place, e.g. when they hold no defined value or live across a loop. That costs
/// most of the kernel's speed and no test of results would notice, so the build log is checked.
#[test]
fn fast_kernels_keep_wgmma_asynchronous() {
    if !nvrtc_or_skip() {
        return;
    }
    for fam in dsv4::cuda::kernels::FAST_FAMILIES {
        let (_, log) = fam
            .compile_with_log(ARCH, &["--ptxas-options=-v"])
            .unwrap_or_else(|e| panic!("{}: {e}", fam.family));
        // Registers and spills, for whoever tunes these kernels.
        for l in log
            .lines()
            .filter(|l| l.contains("registers") || l.contains("spill"))
        {
            println!("{}: {}", fam.family, l.trim());
        }
        let serialized: Vec<&str> = log.lines().filter(|l| l.contains("C7511")).collect();
        println!(
            "{}: {} wgmma serialisation notes",
            fam.family,
            serialized.len()
        );
        assert!(
            serialized.is_empty(),
            "kernel family `{}`: ptxas serialises wgmma:\n{}",
            fam.family,
            serialized.join("\n")
        );
    }
}

#[test]
fn cubin_cache_compiles_once_then_hits_and_replaces_corrupt_files() {
    if !nvrtc_or_skip() {
        return;
    }
    let dir = TempDir::new("kcache");
    let cache = KernelCache::new(Some(&dir.0));
    let fam = &dsv4::cuda::smoke::SOURCE;

    let (first, o1) = cache.cubin(fam, ARCH).unwrap();
    assert_eq!(o1, CacheOutcome::Compiled);
    let path = cache.path_for(fam, ARCH).unwrap().unwrap();
    assert!(path.exists(), "cache file {} not written", path.display());
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("smoke-sm_90a-") && name.ends_with(".cubin"),
        "{name}"
    );
    // No temp files left behind by the atomic write.
    let entries: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");

    let (second, o2) = cache.cubin(fam, ARCH).unwrap();
    assert_eq!(o2, CacheOutcome::Hit);
    assert_eq!(first, second);

    // Flip one byte in the middle of the CUBIN: the checksum catches it and we recompile.
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let (third, o3) = cache.cubin(fam, ARCH).unwrap();
    assert_eq!(o3, CacheOutcome::Recompiled);
    assert_eq!(third, first);
    assert_eq!(
        cache.cubin(fam, ARCH).unwrap().1,
        CacheOutcome::Hit,
        "the corrupt file was rewritten"
    );

    // Truncated and empty files too.
    std::fs::write(&path, &bytes[..10]).unwrap();
    assert_eq!(cache.cubin(fam, ARCH).unwrap().1, CacheOutcome::Recompiled);
    std::fs::write(&path, b"").unwrap();
    assert_eq!(cache.cubin(fam, ARCH).unwrap().1, CacheOutcome::Recompiled);

    // Another arch is another key (another file).
    assert_ne!(
        cache.path_for(fam, "sm_80").unwrap(),
        cache.path_for(fam, ARCH).unwrap()
    );

    // An unwritable cache directory costs a recompile, never a failure.
    let blocker = dir.0.join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let bad = KernelCache::new(Some(&blocker.join("sub")));
    assert_eq!(bad.cubin(fam, ARCH).unwrap().1, CacheOutcome::Compiled);
    assert_eq!(bad.cubin(fam, ARCH).unwrap().1, CacheOutcome::Compiled);
}

/// The entry point `k()` of the probe families below.
const K: KernelFn = KernelFn {
    name: "k",
    dynamic_smem: 0,
    params: &[],
};

/// A family calling a helper that does not exist.
const BROKEN: KernelSource = KernelSource {
    family: "broken",
    source: "#include \"common.cuh\"\nextern \"C\" __global__ void k(float* o) { o[0] = no_such_helper(1.0f); }\n",
    functions: &[KernelFn {
        params: &["float*"],
        ..K
    }],
};

/// wgmma exists only on the arch-specific target: it assembles for sm_90a, not sm_90.
const WGMMA: KernelSource = KernelSource {
    family: "wgmma_probe",
    source: "extern \"C\" __global__ void k() { asm volatile(\"wgmma.fence.sync.aligned;\\n\" ::: \"memory\"); }\n",
    functions: &[K],
};

#[test]
fn compile_errors_name_the_family_and_the_first_error() {
    if !nvrtc_or_skip() {
        return;
    }
    let e = BROKEN.compile(ARCH).unwrap_err();
    assert_eq!(e.status, Status::Cuda, "{e}");
    let first = e.message.lines().next().unwrap();
    assert!(
        first.contains("`broken`") && first.contains("no_such_helper") && first.contains("error"),
        "{first}"
    );

    // Kernels must be header-free: a system header is not found.
    const SYSTEM_HEADER: KernelSource = KernelSource {
        family: "sysheader",
        source: "#include <cuda_bf16.h>\nextern \"C\" __global__ void k() {}\n",
        functions: &[],
    };
    let e = SYSTEM_HEADER.compile(ARCH).unwrap_err();
    assert!(e.message.contains("`sysheader`"), "{e}");
}

#[test]
fn sm_90a_enables_hopper_arch_specific_instructions() {
    if !nvrtc_or_skip() {
        return;
    }
    // This proves the registry's options really select sm_90a (the MoE/attention GEMMs need it).
    let cubin = WGMMA.compile(ARCH).unwrap_or_else(|e| panic!("{e}"));
    assert!(cubin_defines(&cubin, "k"));
    let e = WGMMA.compile("sm_90").unwrap_err();
    assert!(e.message.contains("wgmma"), "{e}");
}
