//! Kernel registry: every kernel family in kernels/*.cu, embedded in the library, compiled
//! with NVRTC to CUBIN for the device's exact architecture (sm_90a on Hopper), cached on
//! disk, loaded into the context and resolved to `CUfunction`s with their attributes set.
//!
//! All of this happens at finalize. Must never: compile, load or look anything up on disk
//! during forward; use `--use_fast_math` (numerics must match the CPU reference); rely on
//! system headers (kernels are header-free; `common.cuh` is injected as an NVRTC header).
//!
//! Adding a family: write `kernels/<family>.cu` (`#include "common.cuh"`, `extern "C"
//! __global__` entry points), add `src/cuda/kernels/<family>.rs` with a `kernel_family!`
//! declaration (src/cuda/decl.rs: the family's `SOURCE` and every entry point's parameters
//! and dynamic shared memory above 48 KB) and a `launchers!` wrapper struct naming one
//! `Launcher` per entry point, and add `&<family>::SOURCE` to `MODEL_FAMILIES`
//! (src/cuda/kernels/mod.rs), which [`families`] includes. CI then compiles it with NVRTC
//! (tests/kernels_compile.rs) and checks every declaration against the source's signatures
//! (tests/kernel_decls.rs).
//!
//! Adding a kernel to a family: the `extern "C" __global__` function in the .cu file, one
//! `fn name(param: Type, ...);` line in the family's `kernel_family!`, a field in the
//! wrapper struct's `launchers!` and a wrapper method that checks sizes (`need`) and launches with
//! `name::Args { .. }`. No `unsafe` in the wrapper: the launch is typed by the declaration.

use super::libs::CudaLib;
use super::{Context, check};
use crate::error::{Error, Result, Status};
use cudarc::driver::sys as cu;
use cudarc::nvrtc::sys as nv;
use std::ffi::{CString, c_char};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// One `extern "C" __global__` entry point of a family, as its declaration
/// ([`crate::kernel_family!`], src/cuda/decl.rs) describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelFn {
    pub name: &'static str,
    /// Largest dynamic shared memory any launch uses, in bytes. Above 48 KB the registry
    /// raises the kernel's limit (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES); 0 means
    /// the default allowance (48 KB minus static shared memory).
    pub dynamic_smem: u32,
    /// The C type of every parameter in order, normalised as [`super::decl::Param::C`]
    /// (tests/kernel_decls.rs checks them against the .cu source).
    pub params: &'static [&'static str],
    /// The kernel begins with `dsv4_pdl_begin()` (kernels/common.cuh): it touches no memory a
    /// kernel before it on the stream writes or reads until that kernel has finished, so it is
    /// launched as a programmatic dependent (sm_90 on) and its launch and block scheduling
    /// overlap the previous kernel's tail (tests/kernel_decls.rs checks the source).
    pub pdl: bool,
    /// Most blocks a cluster of its launches may hold: [`PORTABLE_CLUSTER`], or more (16 on
    /// H100 / H200), for which the registry allows non-portable cluster sizes
    /// (CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED). Whether a device schedules such a
    /// cluster depends on the kernel's resources; a launch it cannot schedule fails.
    pub max_cluster: u32,
}

/// The largest thread-block cluster every device with clusters runs (CUDA's portable size).
pub const PORTABLE_CLUSTER: u32 = 8;

/// A kernel family: one .cu file and the entry points it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    pub family: &'static str,
    pub source: &'static str,
    pub functions: &'static [KernelFn],
}

/// Headers every family may `#include "<name>"`, injected into NVRTC (no include path):
/// the files in kernels/ and `dsv4_consts.cuh`, generated from Rust ([`super::consts`]).
/// Their contents are part of every family's cache key.
pub fn headers() -> [(&'static str, &'static str); 11] {
    [
        (super::consts::HEADER_NAME, super::consts::header()),
        ("common.cuh", include_str!("../../kernels/common.cuh")),
        ("ref_math.cuh", include_str!("../../kernels/ref_math.cuh")),
        ("norm_row.cuh", include_str!("../../kernels/norm_row.cuh")),
        ("kv_pages.cuh", include_str!("../../kernels/kv_pages.cuh")),
        ("attn_keys.cuh", include_str!("../../kernels/attn_keys.cuh")),
        ("gemm_core.cuh", include_str!("../../kernels/gemm_core.cuh")),
        ("fp8_mma.cuh", include_str!("../../kernels/fp8_mma.cuh")),
        (
            "fast_moe_common.cuh",
            include_str!("../../kernels/fast_moe_common.cuh"),
        ),
        (
            "fast_moe_route.cuh",
            include_str!("../../kernels/fast_moe_route.cuh"),
        ),
        ("moe_plan.cuh", include_str!("../../kernels/moe_plan.cuh")),
    ]
}

/// Every kernel family the library embeds: the runtime's `smoke` family, then the model's
/// families (`cuda::kernels::MODEL_FAMILIES`), then the fast set's (`FAST_FAMILIES`), the
/// backend's own (`BACKEND_FAMILIES`: device-side weight writes), then the test- and bench-only
/// `wgmma_probe` and `read_probe`. [`Registry::load`] compiles and loads all of them; an engine loads
/// only its kernel set's families.
pub fn families() -> Vec<&'static KernelSource> {
    std::iter::once(&super::smoke::SOURCE)
        .chain(super::kernels::MODEL_FAMILIES.iter().copied())
        .chain(super::kernels::FAST_FAMILIES.iter().copied())
        .chain(super::kernels::BACKEND_FAMILIES.iter().copied())
        .chain(std::iter::once(&super::wgmma_probe::SOURCE))
        .chain(std::iter::once(&super::read_probe::SOURCE))
        .collect()
}

/// Default dynamic shared memory allowance of a kernel without an opt-in.
const DEFAULT_SMEM_LIMIT: u32 = 48 * 1024;

/// Bump when the cache file layout or anything else that changes CUBINs outside the key
/// changes.
const CACHE_FORMAT: u64 = 1;
const CACHE_MAGIC: &[u8; 8] = b"DSV4CUB1";

/// NVRTC options for `arch` (e.g. "sm_90a"). Deliberately no `--use_fast_math`: IEEE
/// division/sqrt and denormals, as the CPU reference computes.
pub fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".into(),
        "-default-device".into(),
        "-lineinfo".into(),
    ]
}

/// NVRTC's (major, minor) version, loading libnvrtc first ([`super::libs::load`]; cudarc
/// panics when it is missing). `Unsupported` naming every place searched when it cannot be
/// loaded.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    static V: OnceLock<Result<(i32, i32)>> = OnceLock::new();
    V.get_or_init(|| {
        let lib = super::libs::load(CudaLib::Nvrtc)?;
        std::panic::catch_unwind(|| {
            let (mut major, mut minor) = (0, 0);
            // SAFETY: writes two ints.
            let r = unsafe { nv::nvrtcVersion(&mut major, &mut minor) };
            match r {
                nv::nvrtcResult::NVRTC_SUCCESS => Ok((major, minor)),
                e => Err(Error::new(
                    Status::Unsupported,
                    format!("nvrtcVersion ({}) failed: {e:?}", lib.path.display()),
                )),
            }
        })
        .unwrap_or_else(|_| {
            Err(Error::new(
                Status::Unsupported,
                format!(
                    "{} was found but could not be used (missing symbols?)",
                    lib.path.display()
                ),
            ))
        })
    })
    .clone()
}

struct Program(nv::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        unsafe { nv::nvrtcDestroyProgram(&mut self.0) };
    }
}

fn nvrtc_check(family: &str, what: &str, r: nv::nvrtcResult) -> Result<()> {
    match r {
        nv::nvrtcResult::NVRTC_SUCCESS => Ok(()),
        e => Err(Error::new(
            Status::Cuda,
            format!("kernel family `{family}`: {what} failed: {e:?}"),
        )),
    }
}

/// The first line of an NVRTC log that reports an error (else its first non-empty line).
fn first_error_line(log: &str) -> &str {
    log.lines()
        .find(|l| l.contains("error"))
        .or_else(|| log.lines().find(|l| !l.trim().is_empty()))
        .unwrap_or("(empty NVRTC log)")
        .trim()
}

impl KernelSource {
    /// Compiles the family with NVRTC to a CUBIN for `arch`. A compile error is `Cuda`
    /// naming the family and the first error line, with the whole NVRTC log after it.
    pub fn compile(&self, arch: &str) -> Result<Vec<u8>> {
        self.compile_with_log(arch, &[]).map(|(cubin, _)| cubin)
    }

    /// [`KernelSource::compile`] with `extra` NVRTC options after the usual ones, returning the
    /// NVRTC log too (e.g. with `--ptxas-options=-v`, ptxas's resource and performance notes).
    pub fn compile_with_log(&self, arch: &str, extra: &[&str]) -> Result<(Vec<u8>, String)> {
        nvrtc_version()?;
        std::panic::catch_unwind(|| self.compile_unchecked(arch, extra)).unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("panic");
            Err(Error::new(
                Status::Unsupported,
                format!("kernel family `{}`: NVRTC is unusable: {msg}", self.family),
            ))
        })
    }

    fn compile_unchecked(&self, arch: &str, extra: &[&str]) -> Result<(Vec<u8>, String)> {
        let fam = self.family;
        let cstr = |s: &str, what: &str| {
            CString::new(s).map_err(|_| {
                Error::new(
                    Status::Internal,
                    format!("kernel family `{fam}`: {what} contains NUL"),
                )
            })
        };
        let src = cstr(self.source, "source")?;
        let name = cstr(&format!("{fam}.cu"), "name")?;
        let headers = headers();
        let hdr_src = headers
            .iter()
            .map(|(_, s)| cstr(s, "header"))
            .collect::<Result<Vec<_>>>()?;
        let hdr_name = headers
            .iter()
            .map(|(n, _)| cstr(n, "header name"))
            .collect::<Result<Vec<_>>>()?;
        let hdr_src_p: Vec<*const c_char> = hdr_src.iter().map(|s| s.as_ptr()).collect();
        let hdr_name_p: Vec<*const c_char> = hdr_name.iter().map(|s| s.as_ptr()).collect();
        let opts = nvrtc_options(arch)
            .iter()
            .map(String::as_str)
            .chain(extra.iter().copied())
            .map(|o| cstr(o, "option"))
            .collect::<Result<Vec<_>>>()?;
        let opts_p: Vec<*const c_char> = opts.iter().map(|s| s.as_ptr()).collect();

        let mut prog = Program(std::ptr::null_mut());
        // SAFETY: every pointer is a NUL-terminated string alive for the program's lifetime.
        nvrtc_check(fam, "nvrtcCreateProgram", unsafe {
            nv::nvrtcCreateProgram(
                &mut prog.0,
                src.as_ptr(),
                name.as_ptr(),
                headers.len() as i32,
                hdr_src_p.as_ptr(),
                hdr_name_p.as_ptr(),
            )
        })?;
        // SAFETY: valid program and option strings.
        let r = unsafe { nv::nvrtcCompileProgram(prog.0, opts_p.len() as i32, opts_p.as_ptr()) };
        let log = program_log(&prog);
        if r == nv::nvrtcResult::NVRTC_ERROR_BUILTIN_OPERATION_FAILURE {
            return Err(Error::new(
                Status::Unsupported,
                format!(
                    "kernel family `{fam}`: NVRTC could not load libnvrtc-builtins.so.13.0 ({r:?}); set \
                     DSV4_CUDA_LIB_DIR to the directory holding libnvrtc.so.13 and its builtins\n{log}"
                ),
            ));
        }
        if r != nv::nvrtcResult::NVRTC_SUCCESS {
            return Err(Error::new(
                Status::Cuda,
                format!(
                    "kernel family `{fam}` failed to compile for {arch} ({r:?}): {}\n{log}",
                    first_error_line(&log)
                ),
            ));
        }
        if log.contains("warning") {
            crate::log::info(&format!(
                "kernel family `{fam}` compiled for {arch} with warnings:\n{log}"
            ));
        }
        let mut size = 0usize;
        // SAFETY: valid compiled program.
        nvrtc_check(fam, "nvrtcGetCUBINSize", unsafe {
            nv::nvrtcGetCUBINSize(prog.0, &mut size)
        })?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` has the size NVRTC reported.
        nvrtc_check(fam, "nvrtcGetCUBIN", unsafe {
            nv::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char)
        })?;
        if cubin.len() < 4 || &cubin[..4] != b"\x7fELF" {
            return Err(Error::new(
                Status::Cuda,
                format!("kernel family `{fam}`: NVRTC returned no CUBIN for {arch}"),
            ));
        }
        Ok((cubin, log))
    }

    /// Cache key: FNV-1a 64 of the source, the headers, arch, NVRTC version and options.
    pub fn cache_key(&self, arch: &str, nvrtc: (i32, i32)) -> u64 {
        let mut h = Fnv::new();
        h.field(&CACHE_FORMAT.to_le_bytes());
        h.field(self.family.as_bytes());
        h.field(self.source.as_bytes());
        for (n, s) in headers() {
            h.field(n.as_bytes());
            h.field(s.as_bytes());
        }
        h.field(arch.as_bytes());
        h.field(&nvrtc.0.to_le_bytes());
        h.field(&nvrtc.1.to_le_bytes());
        for o in nvrtc_options(arch) {
            h.field(o.as_bytes());
        }
        h.0
    }
}

fn program_log(prog: &Program) -> String {
    let mut size = 0usize;
    // SAFETY: valid program.
    if unsafe { nv::nvrtcGetProgramLogSize(prog.0, &mut size) } != nv::nvrtcResult::NVRTC_SUCCESS
        || size == 0
    {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` has the size NVRTC reported.
    if unsafe { nv::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr() as *mut c_char) }
        != nv::nvrtcResult::NVRTC_SUCCESS
    {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).trim_end().to_string()
}

/// FNV-1a 64 with length-prefixed fields (so field boundaries matter).
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= x as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn field(&mut self, b: &[u8]) {
        self.bytes(&(b.len() as u64).to_le_bytes());
        self.bytes(b);
    }
}

fn fnv64(b: &[u8]) -> u64 {
    let mut h = Fnv::new();
    h.bytes(b);
    h.0
}

/// Does a CUBIN define the symbol `name`? (a NUL-delimited string in its ELF string table).
/// Lets tests check a family's function table against the compiled code without a GPU.
pub fn cubin_defines(cubin: &[u8], name: &str) -> bool {
    let mut pat = Vec::with_capacity(name.len() + 2);
    pat.push(0);
    pat.extend_from_slice(name.as_bytes());
    pat.push(0);
    cubin.windows(pat.len()).any(|w| w == pat.as_slice())
}

/// How a CUBIN was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Read from a valid cache file.
    Hit,
    /// Not in the cache: compiled (and written to the cache when it has a directory).
    Compiled,
    /// The cache file was corrupt or unusable: compiled again and rewritten.
    Recompiled,
}

/// On-disk CUBIN cache. Directory: the create option, else `$DSV4_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/dsv4`, else `~/.cache/dsv4`. Files are written atomically (temp file +
/// rename); a corrupt file is recompiled and replaced; an unwritable directory only costs
/// recompiling (logged as a warning), never a failure.
///
/// A cache may also carry preprocessor defines ([`KernelCache::with_defines`]) that every family it
/// compiles gets, keyed separately: the kernel-level benches' `--defines` (one build timing several
/// `#if` variants of a kernel in one device call). An engine's own registry never has any.
#[derive(Clone, Debug)]
pub struct KernelCache {
    dir: Option<PathBuf>,
    /// `-DNAME[=VALUE]` options after the usual ones.
    defines: Vec<String>,
}

impl KernelCache {
    /// The cache for `option` (the create option) or the environment's default directory.
    pub fn new(option: Option<&Path>) -> KernelCache {
        KernelCache {
            dir: option.map(Path::to_path_buf).or_else(default_cache_dir),
            defines: vec![],
        }
    }

    /// A cache that stores nothing (every lookup compiles).
    pub fn disabled() -> KernelCache {
        KernelCache {
            dir: None,
            defines: vec![],
        }
    }

    /// The same cache compiling every family with these preprocessor defines, each `NAME` or
    /// `NAME=VALUE` (NAME an identifier, VALUE without spaces or commas); `InvalidArgument` naming
    /// the first that is not. A benchmark tool's variants: the kernels' own constants come from
    /// the generated dsv4_consts.cuh, and a define of one of them fails to compile.
    pub fn with_defines(mut self, defines: &[String]) -> Result<KernelCache> {
        for d in defines {
            let (name, value) = d.split_once('=').unwrap_or((d, ""));
            let ident = name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ident || value.contains(|c: char| c.is_whitespace() || c == ',') {
                return Err(Error::new(
                    Status::InvalidArgument,
                    format!("kernel define `{d}`: expected NAME or NAME=VALUE"),
                ));
            }
        }
        self.defines = defines.iter().map(|d| format!("-D{d}")).collect();
        Ok(self)
    }

    /// The key of `src`'s CUBIN for `arch` under this cache's defines.
    fn key(&self, src: &KernelSource, arch: &str, nvrtc: (i32, i32)) -> u64 {
        let mut h = Fnv(src.cache_key(arch, nvrtc));
        for d in &self.defines {
            h.field(d.as_bytes());
        }
        h.0
    }

    /// `src` compiled for `arch` with this cache's defines.
    fn compile(&self, src: &KernelSource, arch: &str) -> Result<Vec<u8>> {
        let extra: Vec<&str> = self.defines.iter().map(String::as_str).collect();
        src.compile_with_log(arch, &extra).map(|(cubin, _)| cubin)
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The cache file of `src` for `arch` (None when the cache is disabled).
    pub fn path_for(&self, src: &KernelSource, arch: &str) -> Result<Option<PathBuf>> {
        let Some(dir) = &self.dir else {
            return Ok(None);
        };
        let v = nvrtc_version()?;
        let key = self.key(src, arch, v);
        Ok(Some(
            dir.join(format!("{}-{arch}-{key:016x}.cubin", src.family)),
        ))
    }

    /// The CUBIN of `src` for `arch`: from the cache when a valid file exists, else compiled
    /// and stored.
    pub fn cubin(&self, src: &KernelSource, arch: &str) -> Result<(Vec<u8>, CacheOutcome)> {
        let v = nvrtc_version()?;
        let key = self.key(src, arch, v);
        let Some(path) = self.path_for(src, arch)? else {
            return Ok((self.compile(src, arch)?, CacheOutcome::Compiled));
        };
        let outcome = match std::fs::read(&path) {
            Ok(bytes) => match decode_entry(&bytes, key) {
                Some(cubin) => return Ok((cubin.to_vec(), CacheOutcome::Hit)),
                None => {
                    crate::log::warn(&format!(
                        "kernel cache file {} is corrupt; recompiling",
                        path.display()
                    ));
                    CacheOutcome::Recompiled
                }
            },
            Err(_) => CacheOutcome::Compiled,
        };
        let cubin = self.compile(src, arch)?;
        self.store(&path, key, &cubin);
        Ok((cubin, outcome))
    }

    /// Compiles `src` again, ignoring any cache file, and rewrites the file.
    pub fn recompile(&self, src: &KernelSource, arch: &str) -> Result<Vec<u8>> {
        let cubin = self.compile(src, arch)?;
        if let Some(path) = self.path_for(src, arch)? {
            self.store(&path, self.key(src, arch, nvrtc_version()?), &cubin);
        }
        Ok(cubin)
    }

    fn store(&self, path: &Path, key: u64, cubin: &[u8]) {
        if let Err(e) = write_atomic(path, &encode_entry(key, cubin)) {
            crate::log::warn(&format!(
                "cannot write kernel cache file {}: {e} (kernels will be recompiled next time)",
                path.display()
            ));
        }
    }
}

fn default_cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("DSV4_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("dsv4")))
        .or_else(|| env("HOME").map(|d| d.join(".cache").join("dsv4")))
}

fn encode_entry(key: u64, cubin: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + cubin.len());
    out.extend_from_slice(CACHE_MAGIC);
    out.extend_from_slice(&key.to_le_bytes());
    out.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv64(cubin).to_le_bytes());
    out.extend_from_slice(cubin);
    out
}

/// The CUBIN of a cache file if its magic, key, length, checksum and ELF header all agree.
fn decode_entry(bytes: &[u8], key: u64) -> Option<&[u8]> {
    let u64_at = |o: usize| Some(u64::from_le_bytes(bytes.get(o..o + 8)?.try_into().ok()?));
    if bytes.get(..8)? != CACHE_MAGIC || u64_at(8)? != key {
        return None;
    }
    let len = u64_at(16)? as usize;
    let cubin = bytes.get(32..)?;
    (cubin.len() == len && u64_at(24)? == fnv64(cubin) && cubin.starts_with(b"\x7fELF"))
        .then_some(cubin)
}

fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
    let r = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// A resolved entry point, ready for [`super::launch`].
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    pub family: &'static str,
    pub name: &'static str,
    pub func: cu::CUfunction,
    /// Dynamic shared memory a launch may request.
    pub max_dynamic_smem: u32,
    pub max_threads_per_block: u32,
    pub num_regs: i32,
    pub static_smem: i32,
    /// Per-thread local memory (spills, stack); nonzero deserves a look.
    pub local_bytes: i32,
    /// Launched as a programmatic dependent ([`KernelFn::pdl`], on a device that has it).
    pub pdl: bool,
    /// Most blocks a cluster of its launches may hold ([`KernelFn::max_cluster`]).
    pub max_cluster: u32,
}

// SAFETY: a CUfunction is a handle valid in its context from any thread.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

/// What finalize's kernel step did, for tests and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegistryStats {
    /// Families compiled because the cache had no file for them.
    pub compiled: usize,
    /// Families read from the cache.
    pub cache_hits: usize,
    /// Families whose cache file was corrupt or failed to load, compiled again.
    pub cache_rejected: usize,
    /// Wall time of getting every family's CUBIN (cache reads and NVRTC compiles, in
    /// parallel); module loading excluded.
    pub cubin_time: std::time::Duration,
}

/// Every family's module loaded in the context and every entry point resolved.
pub struct Registry {
    ctx: Context,
    arch: String,
    nvrtc: (i32, i32),
    /// Each loaded family's module, with the family's name.
    modules: Vec<(&'static str, cu::CUmodule)>,
    kernels: Vec<Kernel>,
    stats: RegistryStats,
}

// SAFETY: module and function handles are context-wide; see Context's note on threads.
unsafe impl Send for Registry {}
unsafe impl Sync for Registry {}

impl Registry {
    /// Compiles (or reads from the cache) and loads every family in [`families`] for the
    /// context's device. `cache_dir` is the create option (None: env/default directory).
    pub fn load(ctx: &Context, cache_dir: Option<&Path>) -> Result<Registry> {
        Registry::load_families(ctx, &families(), &KernelCache::new(cache_dir))
    }

    /// As [`Registry::load`] for an explicit list of families and cache.
    pub fn load_families(
        ctx: &Context,
        families: &[&KernelSource],
        cache: &KernelCache,
    ) -> Result<Registry> {
        let nvrtc = nvrtc_version()?;
        let arch = ctx.arch().to_string();
        // Compile families in parallel (NVRTC is thread-safe); load serially.
        let t0 = std::time::Instant::now();
        let cubins: Vec<Result<(Vec<u8>, CacheOutcome)>> = std::thread::scope(|s| {
            let handles: Vec<_> = families
                .iter()
                .map(|f| s.spawn(|| cache.cubin(f, &arch)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::new(
                            Status::Internal,
                            "kernel compile thread panicked",
                        ))
                    })
                })
                .collect()
        });
        let _g = ctx.enter()?;
        let mut reg = Registry {
            ctx: ctx.clone(),
            arch,
            nvrtc,
            modules: Vec::new(),
            kernels: Vec::new(),
            stats: RegistryStats {
                cubin_time: t0.elapsed(),
                ..Default::default()
            },
        };
        for (fam, r) in families.iter().zip(cubins) {
            let (cubin, outcome) = r?;
            let module = match (load_module(fam, &cubin), outcome) {
                (Ok(m), o) => {
                    if crate::log::enabled(crate::log::Level::Debug) {
                        crate::log::debug(&format!(
                            "kernel family {}: {}",
                            fam.family,
                            match o {
                                CacheOutcome::Hit => "cache hit",
                                CacheOutcome::Compiled => "compiled",
                                CacheOutcome::Recompiled => "recompiled",
                            }
                        ));
                    }
                    match o {
                        CacheOutcome::Hit => reg.stats.cache_hits += 1,
                        CacheOutcome::Compiled => reg.stats.compiled += 1,
                        CacheOutcome::Recompiled => reg.stats.cache_rejected += 1,
                    }
                    m
                }
                (Err(e), CacheOutcome::Hit) => {
                    crate::log::warn(&format!(
                        "cached CUBIN of `{}` failed to load ({e}); recompiling",
                        fam.family
                    ));
                    reg.stats.cache_rejected += 1;
                    let t = std::time::Instant::now();
                    let cubin = cache.recompile(fam, &reg.arch)?;
                    reg.stats.cubin_time += t.elapsed();
                    load_module(fam, &cubin)?
                }
                (Err(e), _) => return Err(e),
            };
            reg.modules.push((fam.family, module));
            for f in fam.functions {
                let k = resolve(ctx, fam.family, module, f)?;
                reg.kernels.push(k);
            }
        }
        Ok(reg)
    }

    /// The entry point `name` of `family`; `Internal` if the family's table lacks it.
    pub fn get(&self, family: &str, name: &str) -> Result<Kernel> {
        self.kernels
            .iter()
            .find(|k| k.family == family && k.name == name)
            .copied()
            .ok_or_else(|| {
                Error::new(
                    Status::Internal,
                    format!("kernel `{family}::{name}` is not in the registry"),
                )
            })
    }

    pub fn kernels(&self) -> &[Kernel] {
        &self.kernels
    }

    /// The address and size of the `__device__` variable `name` of `family`'s module, or None
    /// when that module has no such variable (a bench variant's, compiled only with its define,
    /// such as fast_moe_gemm's `FMOE_TRACE` log); `Internal` if the family is not loaded.
    pub fn global(&self, family: &str, name: &str) -> Result<Option<(cu::CUdeviceptr, usize)>> {
        let module = self
            .modules
            .iter()
            .find(|(f, _)| *f == family)
            .map(|&(_, m)| m)
            .ok_or_else(|| {
                Error::new(
                    Status::Internal,
                    format!("kernel family `{family}` is not in the registry"),
                )
            })?;
        let cname = CString::new(name)
            .map_err(|_| Error::new(Status::Internal, format!("bad global name `{name}`")))?;
        let (mut ptr, mut bytes) = (0, 0);
        let _g = self.ctx.enter()?;
        // SAFETY: valid module and NUL-terminated name; writes a pointer and a size.
        let r = unsafe { cu::cuModuleGetGlobal_v2(&mut ptr, &mut bytes, module, cname.as_ptr()) };
        match r {
            cu::CUresult::CUDA_SUCCESS => Ok(Some((ptr, bytes))),
            cu::CUresult::CUDA_ERROR_NOT_FOUND => Ok(None),
            e => check(format!("cuModuleGetGlobal({family}::{name})"), e).map(|_| None),
        }
    }

    pub fn stats(&self) -> RegistryStats {
        self.stats
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.nvrtc
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if let Ok(_g) = self.ctx.enter() {
            for &(_, m) in &self.modules {
                // SAFETY: loaded by us, unloaded once.
                let _ = unsafe { cu::cuModuleUnload(m) };
            }
        }
    }
}

fn load_module(fam: &KernelSource, cubin: &[u8]) -> Result<cu::CUmodule> {
    let mut m = std::ptr::null_mut();
    // SAFETY: `cubin` is a complete ELF image (checked when compiled or read from the cache).
    check(
        format!("cuModuleLoadData(kernel family `{}`)", fam.family),
        unsafe { cu::cuModuleLoadData(&mut m, cubin.as_ptr() as *const std::ffi::c_void) },
    )?;
    Ok(m)
}

fn resolve(
    ctx: &Context,
    family: &'static str,
    module: cu::CUmodule,
    f: &KernelFn,
) -> Result<Kernel> {
    use cu::CUfunction_attribute as A;
    let what = || format!("kernel `{family}::{}`", f.name);
    let cname = CString::new(f.name)
        .map_err(|_| Error::new(Status::Internal, format!("{}: bad name", what())))?;
    let mut func = std::ptr::null_mut();
    // SAFETY: valid module and NUL-terminated name.
    check(format!("cuModuleGetFunction({})", what()), unsafe {
        cu::cuModuleGetFunction(&mut func, module, cname.as_ptr())
    })?;
    // Load the code now even under CUDA_MODULE_LOADING=LAZY, so the first launch (maybe
    // inside a host's graph capture) allocates nothing. cuFuncLoad exists from CUDA 12.4.
    if ctx.info().driver_version >= 12040 {
        // SAFETY: valid function handle.
        check(format!("cuFuncLoad({})", what()), unsafe {
            cu::cuFuncLoad(func)
        })?;
    }
    let attr = |a: A| -> Result<i32> {
        let mut v = 0;
        // SAFETY: valid function handle; writes one int.
        check(format!("cuFuncGetAttribute({}, {a:?})", what()), unsafe {
            cu::cuFuncGetAttribute(&mut v, a, func)
        })?;
        Ok(v)
    };
    let static_smem = attr(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?;
    let max_cluster = if f.max_cluster > PORTABLE_CLUSTER {
        // SAFETY: valid function handle and attribute value.
        check(
            format!(
                "cuFuncSetAttribute({}, NON_PORTABLE_CLUSTER_SIZE_ALLOWED)",
                what()
            ),
            unsafe {
                cu::cuFuncSetAttribute(
                    func,
                    A::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1,
                )
            },
        )?;
        f.max_cluster
    } else {
        PORTABLE_CLUSTER
    };
    let max_dynamic_smem = if f.dynamic_smem > DEFAULT_SMEM_LIMIT {
        let optin = ctx.info().max_shared_mem_per_block_optin as i64;
        if static_smem as i64 + f.dynamic_smem as i64 > optin {
            return Err(Error::new(
                Status::Unsupported,
                format!(
                    "{} needs {} bytes of dynamic + {static_smem} static shared memory; the device allows {optin}",
                    what(),
                    f.dynamic_smem
                ),
            ));
        }
        // SAFETY: valid function handle and attribute value.
        check(
            format!(
                "cuFuncSetAttribute({}, MAX_DYNAMIC_SHARED_SIZE_BYTES)",
                what()
            ),
            unsafe {
                cu::cuFuncSetAttribute(
                    func,
                    A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    f.dynamic_smem as i32,
                )
            },
        )?;
        f.dynamic_smem
    } else {
        DEFAULT_SMEM_LIMIT.saturating_sub(static_smem.max(0) as u32)
    };
    Ok(Kernel {
        family,
        name: f.name,
        func,
        max_dynamic_smem,
        max_threads_per_block: attr(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?.max(0) as u32,
        num_regs: attr(A::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
        static_smem,
        local_bytes: attr(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
        // griddepcontrol is sm_90's; graphs capture programmatic launches from CUDA 12.3.
        pdl: f.pdl && ctx.info().compute_capability.0 >= 9 && ctx.info().driver_version >= 12030,
        max_cluster,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_entries_validate() {
        let cubin = b"\x7fELF some code".to_vec();
        let e = encode_entry(42, &cubin);
        assert_eq!(decode_entry(&e, 42), Some(&cubin[..]));
        assert_eq!(decode_entry(&e, 43), None, "other key");
        let mut bad = e.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert_eq!(decode_entry(&bad, 42), None, "checksum");
        assert_eq!(decode_entry(&e[..e.len() - 1], 42), None, "truncated");
        assert_eq!(decode_entry(&[], 42), None, "empty");
        assert_eq!(
            decode_entry(&encode_entry(1, b"not elf"), 1),
            None,
            "not ELF"
        );
    }

    #[test]
    fn keys_depend_on_every_input() {
        const A: KernelSource = KernelSource {
            family: "a",
            source: "x",
            functions: &[],
        };
        const B: KernelSource = KernelSource { source: "y", ..A };
        let k = A.cache_key("sm_90a", (13, 0));
        assert_eq!(k, A.cache_key("sm_90a", (13, 0)));
        assert_ne!(k, B.cache_key("sm_90a", (13, 0)));
        assert_ne!(k, A.cache_key("sm_80", (13, 0)));
        assert_ne!(k, A.cache_key("sm_90a", (13, 1)));
    }

    #[test]
    fn defines_key_apart_and_refuse_what_is_not_a_define() {
        const A: KernelSource = KernelSource {
            family: "a",
            source: "x",
            functions: &[],
        };
        let v = (13, 0);
        let plain = KernelCache::disabled();
        let d = |list: &[&str]| {
            let list: Vec<String> = list.iter().map(|s| s.to_string()).collect();
            KernelCache::disabled().with_defines(&list)
        };
        let one = d(&["FA_ABLATE=1"]).unwrap();
        let two = d(&["FA_ABLATE=2"]).unwrap();
        let flag = d(&["_X1"]).unwrap();
        assert_eq!(plain.key(&A, "sm_90a", v), A.cache_key("sm_90a", v));
        let keys = [&plain, &one, &two, &flag].map(|c| c.key(&A, "sm_90a", v));
        for i in 0..keys.len() {
            for j in 0..i {
                assert_ne!(keys[i], keys[j], "caches {i} and {j} share a key");
            }
        }
        assert_eq!(one.defines, ["-DFA_ABLATE=1"]);
        for bad in ["", "=1", "1X=2", "A B", "A=1 2", "A=1,B=2", "A-B=1"] {
            let e = d(&[bad]).unwrap_err();
            assert_eq!(e.status, Status::InvalidArgument, "{bad:?}");
            assert!(e.to_string().contains(&format!("`{bad}`")), "{e}");
        }
    }

    #[test]
    fn error_lines_and_symbols() {
        let log =
            "smoke.cu(3): warning: x\nsmoke.cu(7): error: identifier \"y\" is undefined\n1 error";
        assert_eq!(
            first_error_line(log),
            "smoke.cu(7): error: identifier \"y\" is undefined"
        );
        assert!(cubin_defines(b"\x7fELF\0smoke_fill\0other\0", "smoke_fill"));
        assert!(!cubin_defines(b"\x7fELF\0smoke_fill2\0", "smoke_fill"));
    }

    #[test]
    fn families_are_well_formed() {
        let mut names = std::collections::HashSet::new();
        for f in families() {
            assert!(names.insert(f.family), "family `{}` twice", f.family);
            for k in f.functions {
                assert!(
                    f.source.contains(k.name),
                    "`{}` not in {}.cu",
                    k.name,
                    f.family
                );
            }
        }
    }
}
