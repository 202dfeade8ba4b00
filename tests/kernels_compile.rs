//! Compiles EVERY kernel family of the registry with NVRTC to a CUBIN for sm_90a (H100/H200),
//! no GPU needed, and checks the CUBIN cache. Part of the README test command: CI installs
//! nvidia-cuda-nvrtc==13.0.88 into target/pyenv and points DSV4_CUDA_LIB_DIR at its lib
//! directory instead of putting it on LD_LIBRARY_PATH (scripts/test.sh), so this also checks
//! that the library finds NVRTC by itself (src/cuda/libs.rs).
//!
//! DSV4_DUMP_CUBIN_DIR=<dir> writes each family's CUBIN there (for cuobjdump / nvdisasm) and the
//! generated dsv4_consts.cuh;
//! DSV4_COMPILE_FAMILY=<name> compiles one family only (in both tests that compile them).
//!
//! The fast GEMMs' wgmma scheduling is read in their SASS with nvdisasm (DSV4_NVDISASM, which
//! scripts/test.sh installs from pip; without it that test prints `skipped: ...`, and fails
//! under CI).
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

/// The families a test compiles: all of `all`, or the one DSV4_COMPILE_FAMILY names if it is
/// among them (a kernel's edit-compile loop); a name that is no family at all fails the test
/// instead of compiling nothing.
fn chosen<'a>(all: impl IntoIterator<Item = &'a KernelSource>) -> Vec<&'a KernelSource> {
    let Ok(only) = std::env::var("DSV4_COMPILE_FAMILY") else {
        return all.into_iter().collect();
    };
    let known: Vec<_> = families().iter().map(|f| f.family).collect();
    assert!(
        known.contains(&only.as_str()),
        "DSV4_COMPILE_FAMILY={only} names none of {known:?}"
    );
    all.into_iter().filter(|f| f.family == only).collect()
}

#[test]
fn every_family_compiles_to_cubin_for_sm_90a() {
    if !nvrtc_or_skip() {
        return;
    }
    assert_eq!(arch_for(9, 0), ARCH);
    assert!(!families().is_empty());
    let mut failures = Vec::new();
    for fam in chosen(families()) {
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
                    // For inspection with cuobjdump / nvdisasm on a machine that has them; the
                    // generated header too, so a kernel file compiles outside the registry (nvcc:
                    // bench/probes/).
                    let dir = std::path::Path::new(&d);
                    std::fs::write(dir.join(format!("{}-{ARCH}.cubin", fam.family)), &cubin)
                        .unwrap();
                    std::fs::write(
                        dir.join(dsv4::cuda::consts::HEADER_NAME),
                        dsv4::cuda::consts::header(),
                    )
                    .unwrap();
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
/// registers in place, e.g. when they hold no defined value or live across a loop, and (info
/// C7514) when other instructions read a wgmma's accumulators between its issue and the wait ptxas
/// pairs it with, e.g. a commit group waited for in a later loop iteration. That costs most of the
/// kernel's speed and no test of results would notice, so the build log is checked. The same log
/// says whether the families of [`NO_SPILL_FAMILIES`] spill: they must not.
#[test]
fn fast_kernels_keep_wgmma_asynchronous() {
    if !nvrtc_or_skip() {
        return;
    }
    for fam in chosen(dsv4::cuda::kernels::FAST_FAMILIES.iter().copied()) {
        let (_, log) = fam
            .compile_with_log(ARCH, &["--ptxas-options=-v"])
            .unwrap_or_else(|e| panic!("{}: {e}", fam.family));
        check_wgmma_asynchronous(fam.family, &log);
        if NO_SPILL_FAMILIES.contains(&fam.family) {
            check_no_spills(fam.family, &log);
        }
    }
}

/// Families whose registers are budgeted to fit without spilling, so that a spill is a regression
/// (and a silent one: results stay right). The prefill GEMMs (kernels/fast_moe_wide.cu) hand their
/// producer warpgroup's registers to the consumers (`setmaxnreg` 240 / 24); until this check every
/// change there was checked for spills by hand: a value held across the mainloop, or an index from
/// an atomic kept in a register, spilled 48-500 bytes (BENCHMARKS.md, issue 11 forty-sixth and
/// forty-seventh sessions). Other fast families spill a few bytes by design and are only printed.
const NO_SPILL_FAMILIES: [&str; 2] = ["fast_moe_wide", "fast_moe_wide_narrow"];

/// Asserts that ptxas's verbose `log` reports no spill stores or loads for any entry point of the
/// build `what`; the message names each spilling function (its "Compiling entry function" or
/// "Function properties for" line comes before its spill line).
fn check_no_spills(what: &str, log: &str) {
    let mut entry = "";
    let mut spilling = Vec::new();
    for l in log.lines() {
        if l.contains("entry function") || l.contains("Function properties for") {
            entry = l.trim();
        } else if l.contains("spill") && !l.contains(" 0 bytes spill stores, 0 bytes spill loads") {
            spilling.push(format!("{entry}: {}", l.trim()));
        }
    }
    assert!(
        spilling.is_empty(),
        "kernel family `{what}` spills (its register budget is meant to fit):\n{}",
        spilling.join("\n")
    );
}

/// Prints each entry point's registers and spills from ptxas's verbose `log` (its "Compiling entry
/// function" line first, for whoever tunes these kernels) and asserts that ptxas serialised no
/// wgmma: no "wgmma.mma_async instructions are serialized" note, whatever its code (C7511, C7514,
/// C7518, ...: the first check knew two codes, and a C7518 passed it while ptxas put a
/// WARPGROUP.DEPBAR after every wgmma). `what` names the build in both.
fn check_wgmma_asynchronous(what: &str, log: &str) {
    for l in log
        .lines()
        .filter(|l| l.contains("registers") || l.contains("spill") || l.contains("entry function"))
    {
        println!("{what}: {}", l.trim());
    }
    let serialized: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains("instructions are serialized") || l.contains("C7511") || l.contains("C7514")
        })
        .collect();
    println!("{what}: {} wgmma serialisation notes", serialized.len());
    assert!(
        serialized.is_empty(),
        "kernel family `{what}`: ptxas serialises wgmma:\n{}",
        serialized.join("\n")
    );
}

/// The fast kernels' bench variants (`#ifndef` defines that `dsv4 bench --defines` times against
/// the defaults) compile too, and keep their wgmmas asynchronous: a variant that fails here would
/// cost a device call its bench line. (Their registers and spills are printed; some variants, such
/// as three indexer blocks an SM, spill by design.)
#[test]
fn bench_variants_compile_and_keep_wgmma_asynchronous() {
    use dsv4::cuda::kernels::{
        fast_attention, fast_indexer, fast_moe, fast_moe_gemm, fast_moe_wide,
    };
    if !nvrtc_or_skip() {
        return;
    }
    let variants: [(&KernelSource, &str); 31] = [
        (&fast_attention::SOURCE, "FA_DECODE_FAST=0"),
        (&fast_attention::SOURCE, "FA_FETCH_FAST=0"),
        (&fast_attention::SOURCE, "FA_CL_BATCH=1"),
        (&fast_attention::SOURCE, "FA_CL_BATCH=8"),
        (&fast_attention::SOURCE, "FA_SOFTMAX_SPLIT=0"),
        (&fast_indexer::SOURCE, "FI_STREAM_MIN_BLOCKS=3"),
        (&fast_indexer::SOURCE, "FI_TOPK_PLAIN_LOW=0"),
        (&fast_moe::SOURCE, "FMOE_TC_PROBE=1"),
        (&fast_moe::SOURCE, "FMOE_TC_PROBE=2"),
        (&fast_moe::SOURCE, "FMOE_TC_PROBE=4"),
        (&fast_moe::SOURCE, "FMOE_TC_ONE_BANK=1"),
        (&fast_moe_gemm::SOURCE, "FMOE_POLL_ACQUIRE=0"),
        (&fast_moe_gemm::SOURCE, "FMOE_ROUTER_HOLD=0"),
        (&fast_moe_gemm::SOURCE, "FMOE_TRACE=1"),
        (&fast_moe_gemm::SOURCE, "FMOE_RING_SLOTS=3"),
        (&fast_moe_gemm::SOURCE, "FMOE_TAKE_EARLY=1"),
        (&fast_moe_gemm::SOURCE, "FMOE_SHARED_EARLY=0"),
        (&fast_moe_gemm::SOURCE, "FMOE_SPREAD_SHARED=0"),
        (&fast_moe_gemm::SOURCE, "FMOE_PROBE_FLAT=1"),
        (&fast_moe_gemm::SOURCE, "FMOE_PROBE_NO_MATH=1"),
        (&fast_moe_wide::SOURCE, "FMW_PROBE_NO_MATH=1"),
        (&fast_moe_wide::NARROW_SOURCE, "FMW_PROBE_NO_EPI=1"),
        (&fast_moe_wide::SOURCE, "FMW_PROBE_NO_DECODE=1"),
        (&fast_moe_wide::NARROW_SOURCE, "FMW_PROBE_NO_DECODE=1"),
        (&fast_moe_wide::NARROW_SOURCE, "FMW_PREFETCH_ITEM=0"),
        (&fast_moe_wide::SOURCE, "FMW_PREFETCH_ITEM=1"),
        (&fast_moe_wide::SOURCE, "FMW_TRACE=1"),
        (&fast_moe_wide::NARROW_SOURCE, "FMW_TRACE=1"),
        (&fast_moe_wide::SOURCE, "FMW_PROBE_NO_STREAM=1"),
        (&fast_moe_wide::SOURCE, "FMW_PROBE_NO_STREAM=3"),
        (&fast_moe_wide::NARROW_SOURCE, "FMW_PROBE_NO_STREAM=1"),
    ];
    // With nvdisasm, each variant's SASS also keeps its wgmmas' A registers untouched in flight
    // (no_instruction_writes_the_a_registers_of_an_in_flight_wgmma).
    let nvdisasm = nvdisasm_or_skip();
    for (fam, define) in variants {
        if chosen([fam]).is_empty() {
            continue;
        }
        let flag = format!("-D{define}");
        let (cubin, log) = fam
            .compile_with_log(ARCH, &[flag.as_str(), "--ptxas-options=-v"])
            .unwrap_or_else(|e| panic!("{} with {define}: {e}", fam.family));
        check_wgmma_asynchronous(&format!("{} with {define}", fam.family), &log);
        if let Some(nvdisasm) = &nvdisasm {
            let what = format!("{} with {define}", fam.family);
            check_no_in_flight_a_writes(&what, sass_of(fam, &cubin, nvdisasm));
        }
    }
}

/// The warp-specialized attention's roles trade registers with `setmaxnreg`, which takes them from
/// the block's pool: if ptxas gives the kernel fewer registers a thread than the pool needs
/// (`fast_attention::WS_MIN_REGS`), the consumers' `setmaxnreg.inc` waits forever. The host
/// refuses such a launch; this says so at build time, without a GPU.
#[test]
fn warp_specialized_attention_gets_its_register_pool() {
    use dsv4::cuda::kernels::fast_attention::{self, WS_MIN_REGS};
    if !nvrtc_or_skip() {
        return;
    }
    for fam in chosen([&fast_attention::SOURCE]) {
        let (_, log) = fam
            .compile_with_log(ARCH, &["--ptxas-options=-v"])
            .unwrap_or_else(|e| panic!("{}: {e}", fam.family));
        for kernel in [
            "fa_attention_wgmma_ws_kernel",
            "fa_attention_wgmma_ws_early_kernel",
        ] {
            let regs = registers_of(&log, kernel)
                .unwrap_or_else(|| panic!("no register count for {kernel} in ptxas's log:\n{log}"));
            println!("{kernel}: {regs} registers a thread, the pool needs {WS_MIN_REGS}");
            assert!(
                regs >= WS_MIN_REGS,
                "{kernel}: ptxas gave {regs} registers a thread, setmaxnreg's pool needs {WS_MIN_REGS}"
            );
        }
    }
}

/// The registers ptxas's verbose log gives `kernel` ("Compiling entry function 'k'", then its
/// "Used N registers").
fn registers_of(log: &str, kernel: &str) -> Option<usize> {
    let start = log.find(&format!("entry function '{kernel}'"))?;
    let used = &log[start..][log[start..].find("Used ")? + 5..];
    used.split_whitespace().next()?.parse().ok()
}

/// nvdisasm for the SASS checks: DSV4_NVDISASM (scripts/test.sh installs pip's
/// nvidia-cuda-nvdisasm and sets it), else `nvdisasm` on PATH. Without one this prints
/// `skipped: ...`, except under CI, where it fails.
fn nvdisasm_or_skip() -> Option<std::path::PathBuf> {
    let cmd = std::env::var_os("DSV4_NVDISASM")
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "nvdisasm".into());
    match std::process::Command::new(&cmd).arg("--version").output() {
        Ok(o) if o.status.success() => Some(cmd),
        r => {
            let why = format!("nvdisasm ({}) does not run: {r:?}", cmd.display());
            if std::env::var_os("CI").is_some() {
                panic!("CI is set, so nvdisasm must be installed (scripts/test.sh does it): {why}");
            }
            println!("skipped: {why}");
            None
        }
    }
}

/// The SASS of each kernel of `fam`, by name.
fn sass_by_kernel(fam: &KernelSource, nvdisasm: &std::path::Path) -> Vec<(String, String)> {
    let (cubin, _) = fam
        .compile_with_log(ARCH, &[])
        .unwrap_or_else(|e| panic!("{}: {e}", fam.family));
    sass_of(fam, &cubin, nvdisasm)
}

/// The SASS of each kernel of `cubin` (a CUBIN of `fam`), by name.
fn sass_of(fam: &KernelSource, cubin: &[u8], nvdisasm: &std::path::Path) -> Vec<(String, String)> {
    let dir = TempDir::new("sass");
    let file = dir.0.join(format!("{}.cubin", fam.family));
    std::fs::write(&file, cubin).unwrap();
    let out = std::process::Command::new(nvdisasm)
        .arg("-c")
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "nvdisasm: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Sections start with a line `//---- .text.<kernel> ----`.
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut kernels: Vec<(String, String)> = vec![];
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("//").filter(|l| l.contains(".text.")) {
            let name = rest
                .split(".text.")
                .nth(1)
                .unwrap_or("")
                .split_whitespace()
                .next();
            kernels.push((name.unwrap_or("").to_string(), String::new()));
        } else if let Some((_, body)) = kernels.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    kernels
}

/// What ptxas does with the fast GEMMs' wgmmas, read in the SASS: no result test can see a
/// wgmma that waits for its own completion, only a benchmark can, and ptxas says nothing (no
/// C7511). The prefill GEMMs chain a 128-block's four wgmmas in the tensor core: the first three
/// carry no `gsb0` (a `wgmma.fence` between them made ptxas wait after each: 5x slower,
/// BENCHMARKS.md), so every run of wgmmas without `gsb0` is 3 long (the fallback that promotes
/// every k32 has runs of 0). The decode GEMMs keep one wgmma in flight while they promote the
/// previous one (`WARPGROUP.DEPBAR.LE gsb0, 0x1`).
#[test]
fn fast_gemms_keep_wgmmas_in_flight_in_the_sass() {
    use dsv4::cuda::kernels::{fast_moe_gemm, fast_moe_wide};
    if !nvrtc_or_skip() {
        return;
    }
    let Some(nvdisasm) = nvdisasm_or_skip() else {
        return;
    };
    for family in [&fast_moe_wide::SOURCE, &fast_moe_wide::NARROW_SOURCE] {
        let wide = sass_by_kernel(family, &nvdisasm);
        for k in ["fmw_up_kernel", "fmw_down_kernel"] {
            let (_, sass) = wide.iter().find(|(n, _)| n == k).expect(k);
            let runs = wgmma_runs(sass);
            println!("{} {k}: runs of chained wgmmas {runs:?}", family.family);
            assert!(
                runs.contains(&3) && runs.iter().all(|&r| r == 0 || r == 3),
                "{} {k}: a 128-block's wgmmas are not chained four at a time: {runs:?}",
                family.family
            );
        }
    }
    let decode = sass_by_kernel(&fast_moe_gemm::SOURCE, &nvdisasm);
    for k in ["fmoe_up_kernel", "fmoe_down_kernel"] {
        let (_, sass) = decode.iter().find(|(n, _)| n == k).expect(k);
        // A 128-block's four k32 wgmmas go out back to back, one commit group: three without
        // gsb0, then one with it (ptxas marks every wgmma gsb0 when it serialises them).
        let runs = wgmma_runs(sass);
        println!("{k}: runs of back-to-back wgmmas {runs:?}");
        assert!(
            !runs.is_empty() && runs.iter().all(|&r| r == 3),
            "{k}: a 128-block's wgmmas are not issued four at a time: {runs:?}"
        );
    }
}

/// No instruction writes a register that a wgmma still in flight reads as its A operand. A wgmma
/// with A in registers (`HGMMA` / `QGMMA ..., Ra, gdesc[..]`) reads Ra .. Ra + 3 until its commit
/// group is waited for (`WARPGROUP.DEPBAR.LE gsb0, n`); PTX leaves writing them before that
/// undefined, and the compiler does not stop it: to the C++ the asm's inputs are dead once issued,
/// so next operands built while these wgmmas run may get their registers (FMOE_TC_OVERLAP, measured
/// in the fifty-first session: the next item's shared loads landed in the in-flight wgmmas' A
/// registers before the wait, and an f32-gate case differed). No result test sees this reliably
/// (the wgmma usually reads its A early); the SASS shows it. Every fast family with wgmmas in its
/// default build here, and every bench variant in `bench_variants_compile_and_keep_wgmma_asynchronous`.
#[test]
fn no_instruction_writes_the_a_registers_of_an_in_flight_wgmma() {
    use dsv4::cuda::kernels::{
        fast_attention, fast_indexer, fast_moe, fast_moe_gemm, fast_moe_wide,
    };
    // The check finds what it looks for: FMOE_TC_OVERLAP's SASS, cut down.
    let overlap = "
        /*1c20*/                   HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR4], R24, UP0 ;
        /*1c90*/                   HGMMA.64x64x16.F32.BF16 R24, R60, gdesc[UR4], R24 ;
        /*1d20*/                   HGMMA.64x64x16.F32.BF16 R24, R68, gdesc[UR4], R24, gsb0 ;
        /*1d70*/              @!P0 LDS R80, [R80+0x33000] ;
        /*1ef0*/                   LDS.64 R56, [R110] ;
        /*1fa0*/                   F2FP.BF16.F32.PACK_AB R71, R81, R80 ;
        /*1fb0*/                   STS [R2], R60 ;
        /*2100*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*2110*/                   LDS.64 R60, [R110+0x920] ;
        /*2120*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, R112, gdesc[UR16], R24, gsb0 ;
        /*2130*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, R116, gdesc[UR16], R24, gsb0 ;
        /*2140*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*2150*/                   IMAD.WIDE.U32 R112, R1, 0x4, RZ ;
        /*2160*/                   LDSM.16.M88.4 R116, [R3] ;
    ";
    let found = in_flight_a_writes(overlap);
    assert_eq!(found.len(), 3, "{found:#?}");
    assert!(
        found[0].contains("LDS.64 R56") && found[1].contains("PACK_AB R71"),
        "{found:#?}"
    );
    assert!(found[2].contains("LDSM.16.M88.4 R116"), "{found:#?}");
    if !nvrtc_or_skip() {
        return;
    }
    let Some(nvdisasm) = nvdisasm_or_skip() else {
        return;
    };
    let families = [
        &fast_moe::SOURCE,
        &fast_moe_gemm::SOURCE,
        &fast_moe_wide::SOURCE,
        &fast_moe_wide::NARROW_SOURCE,
        &fast_indexer::SOURCE,
        &fast_attention::SOURCE,
    ];
    for fam in chosen(families) {
        check_no_in_flight_a_writes(fam.family, sass_by_kernel(fam, &nvdisasm));
    }
}

/// Fails naming `what` and the kernel if any of `kernels` (name, SASS) writes an in-flight wgmma's
/// A registers ([`in_flight_a_writes`]).
fn check_no_in_flight_a_writes(what: &str, kernels: Vec<(String, String)>) {
    for (kernel, sass) in kernels {
        let found = in_flight_a_writes(&sass);
        assert!(
            found.is_empty(),
            "{what} {kernel}: writes to an in-flight wgmma's A registers:\n{}",
            found.join("\n")
        );
    }
}

/// The instructions of `sass` (nvdisasm's lines, one function, in address order) that write a
/// register an in-flight wgmma reads as its A operand. Groups: a wgmma with `gsb0` closes the
/// group its predecessors opened; `WARPGROUP.DEPBAR.LE gsb0, n` leaves the last n in flight. A
/// written register is an instruction's first operand when it is `Rn` (stores and reductions
/// start with an address); the width comes from the opcode (.64, .128, LDSM's .2 / .4, the wide
/// IMAD, CS2R). The scan follows the addresses, not the branches: a group still in flight across
/// a loop's back edge is checked only up to the end of the code.
fn in_flight_a_writes(sass: &str) -> Vec<String> {
    let (mut groups, mut open): (Vec<Vec<u32>>, Vec<u32>) = (vec![], vec![]);
    let mut found = vec![];
    for line in sass.lines() {
        let Some(at) = line.find("*/") else { continue };
        let text = line[at + 2..].split(';').next().unwrap_or("").trim();
        let ins = text
            .strip_prefix('@')
            .map_or(text, |p| p.split_once(' ').map_or("", |(_, r)| r));
        let (op, operands) = ins.split_once(' ').unwrap_or((ins, ""));
        let reg = |s: &str| {
            s.trim()
                .strip_prefix('R')
                .and_then(|n| n.parse::<u32>().ok())
        };
        if op.starts_with("WARPGROUP.DEPBAR") {
            let keep = operands
                .rsplit(',')
                .next()
                .and_then(|n| u32::from_str_radix(n.trim().trim_start_matches("0x"), 16).ok())
                .unwrap_or(0) as usize;
            groups.drain(..groups.len().saturating_sub(keep));
            continue;
        }
        if ["HGMMA", "QGMMA", "IGMMA"]
            .iter()
            .any(|g| op.starts_with(g))
        {
            if let Some(a) = operands.split(',').nth(1).and_then(reg) {
                open.extend(a..a + 4);
            }
            if operands.contains("gsb0") {
                groups.push(std::mem::take(&mut open));
            }
            continue;
        }
        let Some(first) = operands.split(',').next().and_then(reg) else {
            continue;
        };
        let width = if op.contains(".128") || (op.starts_with("LDSM") && op.ends_with(".4")) {
            4
        } else if op.contains(".64")
            || op.starts_with("CS2R")
            || op.starts_with("IMAD.WIDE")
            || (op.starts_with("LDSM") && op.ends_with(".2"))
        {
            2
        } else {
            1
        };
        let live = groups.iter().flatten().chain(&open);
        if live.clone().any(|r| (first..first + width).contains(r)) {
            found.push(text.to_string());
        }
    }
    found
}

/// The lengths of the runs of wgmmas without gsb0 before each one with it, in SASS order.
fn wgmma_runs(sass: &str) -> Vec<usize> {
    let (mut runs, mut run) = (vec![], 0);
    for l in sass.lines().filter(|l| l.contains("GMMA.")) {
        if l.contains("gsb0") {
            runs.push(run);
            run = 0;
        } else {
            run += 1;
        }
    }
    runs
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
    pdl: false,
    max_cluster: dsv4::cuda::registry::PORTABLE_CLUSTER,
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

/// A cache's defines reach the compiler, and a cached CUBIN of one define set is not served to
/// another: a family that compiles only with `DSV4_TEST_VARIANT=2` (`dsv4 bench --defines`).
#[test]
fn cache_defines_reach_nvrtc_and_key_their_own_files() {
    if !nvrtc_or_skip() {
        return;
    }
    const VARIANT: KernelSource = KernelSource {
        family: "variant",
        source: "#if !defined(DSV4_TEST_VARIANT) || DSV4_TEST_VARIANT != 2\n#error \"variant 2 only\"\n#endif\n\
                 extern \"C\" __global__ void k() {}\n",
        functions: &[],
    };
    let dir = TempDir::new("kernel-defines");
    let with = |d: &str| {
        KernelCache::new(Some(&dir.0))
            .with_defines(&[d.to_string()])
            .unwrap()
    };
    let (cubin, outcome) = with("DSV4_TEST_VARIANT=2").cubin(&VARIANT, ARCH).unwrap();
    assert!(cubin_defines(&cubin, "k") && outcome == CacheOutcome::Compiled);
    let (_, again) = with("DSV4_TEST_VARIANT=2").cubin(&VARIANT, ARCH).unwrap();
    assert_eq!(again, CacheOutcome::Hit);
    // Another value, or none, is not the cached file's: it compiles, and fails.
    for cache in [with("DSV4_TEST_VARIANT=3"), KernelCache::new(Some(&dir.0))] {
        let e = cache.cubin(&VARIANT, ARCH).unwrap_err();
        assert!(e.message.contains("variant 2 only"), "{e}");
    }
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
