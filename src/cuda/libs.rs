//! Finds and loads the CUDA libraries the backend needs, the driver (`libcuda.so.1`), NVRTC
//! (`libnvrtc.so.13`) and, for the fast kernel set's many-token projections, cuBLASLt
//! (`libcublasLt.so.13`), without help from `LD_LIBRARY_PATH`, before cudarc first touches
//! them. [`load`] is called by `cuda::device_count` (driver), `registry::nvrtc_version` (NVRTC)
//! and `cuda::blockscaled_gemm` (cuBLASLt); nothing else here is needed by the backend.
//!
//! A copy the process already holds (loaded by the host, e.g. PyTorch) is used as it is: cudarc
//! would bind to it anyway, and a second driver would not share the host's contexts. Else the
//! search order, first that loads wins ([`candidates`]):
//! - NVRTC and cuBLASLt: `$DSV4_CUDA_LIB_DIR` (a directory, or a `:`-separated list); `$CUDA_HOME`, then
//!   `$CUDA_PATH`, each `lib64`, `lib` and `targets/<arch>-linux/lib`; `/usr/local/cuda/lib64`;
//!   `/usr/local/cuda-13*/lib64` (newest first); pip's `nvidia/cu13/lib` in the site-packages
//!   of `$VIRTUAL_ENV`, then `$CONDA_PREFIX`; then the system loader path (plain
//!   `libnvrtc.so.13`, `libnvrtc.so`: `LD_LIBRARY_PATH`, `ld.so.cache`, `/lib`, `/usr/lib`).
//!   PyTorch's CUDA 13 wheels hold both in that pip directory.
//! - Driver: `$DSV4_CUDA_LIB_DIR`; the system loader path (`libcuda.so.1`, `libcuda.so`),
//!   where the driver installs it; then `/usr/local/nvidia/lib64` (containers) and
//!   `/usr/lib/wsl/lib` (WSL). Never a toolkit directory: those hold only `stubs/libcuda.so`,
//!   whose `cuInit` fails.
//!
//! How cudarc ends up using our choice. cudarc 0.19 (`dynamic-loading`) takes no path: its
//! `driver::sys::culib()` / `nvrtc::sys::culib()` dlopen (through libloading: RTLD_LAZY |
//! RTLD_LOCAL) the plain names of `get_lib_name_candidates` in order ("libnvrtc.so",
//! "libnvrtc64.so", ..., "libnvrtc.so.13", ...) and keep the first that opens. glibc's
//! dlopen of a name without a slash first returns an object ALREADY loaded whose name or
//! DT_SONAME equals it (`_dl_map_object` in elf/dl-load.c), however that object was opened;
//! a file found on the search path that is the same file (device + inode) as a loaded object
//! is that object too. So we dlopen the chosen file by its absolute path and never close it:
//! cudarc's "libnvrtc.so.13" / "libcuda.so.1" then resolves to it. RTLD_LOCAL is enough for
//! that (RTLD_GLOBAL would only let CUDA's symbols interpose in a host process). NVRTC finds
//! its builtins the same way (a plain dlopen of `"libnvrtc-builtins.so.13.<minor>"`, no
//! RUNPATH), so the builtins beside the libnvrtc in use are loaded too: without that, pip's
//! NVRTC outside the loader path fails every compile with
//! NVRTC_ERROR_BUILTIN_OPERATION_FAILURE.
//!
//! One gap: cudarc tries "libnvrtc.so" / "libcuda.so" before the sonames, so a DIFFERENT file
//! of that name on the system loader path wins over our choice. [`load`] compares the
//! address of a symbol through cudarc and through our handle, reports the file cudarc really
//! uses, and warns when they differ.
//!
//! Must never: dlclose what it opened (cudarc's lookups rely on it staying loaded); panic.

use crate::error::{Error, Result, Status};
use std::ffi::{CStr, CString, OsString, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Environment variable naming the directory (or `:`-separated directories) searched first.
pub const LIB_DIR_ENV: &str = "DSV4_CUDA_LIB_DIR";

/// The CUDA major version whose libraries we load (cudarc is built with `cuda-13000`).
const CUDA_MAJOR: &str = "13";

/// `targets/<this>/lib` inside a CUDA toolkit.
const TARGET_DIR: &str = if cfg!(target_arch = "aarch64") {
    "sbsa-linux"
} else {
    "x86_64-linux"
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaLib {
    /// `libcuda.so.1`, installed with the NVIDIA driver.
    Driver,
    /// `libnvrtc.so.13`, from the CUDA 13 toolkit or pip's `nvidia-cuda-nvrtc`.
    Nvrtc,
    /// `libcublasLt.so.13`, from the CUDA 13 toolkit or pip's `nvidia-cublas`: optional (the
    /// fast set's block-scaled FP8 / BF16 GEMMs above a few dozen tokens; without it the
    /// fast set's own kernels run them).
    CublasLt,
}

impl CudaLib {
    /// The file looked for in each directory (also the soname cudarc finds it by).
    pub fn file_name(self) -> &'static str {
        match self {
            CudaLib::Driver => "libcuda.so.1",
            CudaLib::Nvrtc => "libnvrtc.so.13",
            CudaLib::CublasLt => "libcublasLt.so.13",
        }
    }

    /// Names given to the system loader, in order.
    fn loader_names(self) -> &'static [&'static str] {
        match self {
            CudaLib::Driver => &["libcuda.so.1", "libcuda.so"],
            CudaLib::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so"],
            CudaLib::CublasLt => &["libcublasLt.so.13", "libcublasLt.so"],
        }
    }

    fn label(self) -> &'static str {
        match self {
            CudaLib::Driver => "CUDA driver library",
            CudaLib::Nvrtc => "NVRTC",
            CudaLib::CublasLt => "cuBLASLt",
        }
    }

    /// A symbol every version exports: tells which file a handle or cudarc really uses.
    fn probe_symbol(self) -> &'static CStr {
        match self {
            CudaLib::Driver => c"cuInit",
            CudaLib::Nvrtc => c"nvrtcVersion",
            CudaLib::CublasLt => c"cublasLtGetVersion",
        }
    }

    /// Status when the library cannot be loaded (what callers reported before this file).
    fn missing_status(self) -> Status {
        match self {
            CudaLib::Driver => Status::NoDevice,
            CudaLib::Nvrtc | CudaLib::CublasLt => Status::Unsupported,
        }
    }

    fn advice(self) -> String {
        match self {
            CudaLib::Driver => format!(
                "is the NVIDIA driver installed? If its libcuda.so.1 lives elsewhere, set \
                 {LIB_DIR_ENV} to that directory"
            ),
            CudaLib::Nvrtc => format!(
                "the CUDA backend compiles its kernels at finalize with NVRTC 13: install it \
                 (pip install nvidia-cuda-nvrtc==13.0.88, or the CUDA 13 toolkit) and, if it is \
                 in none of these places, set {LIB_DIR_ENV} to its lib directory (e.g. \
                 site-packages/nvidia/cu13/lib)"
            ),
            CudaLib::CublasLt => format!(
                "the fast kernel set runs projections of many tokens through cuBLASLt 13 \
                 (block-scaled FP8 needs 12.9 or later): install it (pip install \
                 nvidia-cublas==13.*, or the CUDA 13 toolkit) and, if it is in none of these \
                 places, set {LIB_DIR_ENV} to its lib directory"
            ),
        }
    }
}

/// One place to look for a library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// An absolute file path, or a bare file name for the system loader's own search.
    pub path: PathBuf,
    /// Where the entry comes from, for messages: "DSV4_CUDA_LIB_DIR", "$CUDA_HOME",
    /// "system loader path", ...
    pub source: String,
}

impl Candidate {
    fn file(dir: &Path, lib: CudaLib, source: impl Into<String>) -> Candidate {
        Candidate {
            path: dir.join(lib.file_name()),
            source: source.into(),
        }
    }

    /// A bare name, resolved by the system loader rather than looked up as a file.
    pub fn on_loader_path(&self) -> bool {
        !self.path.is_absolute()
    }
}

/// Every place [`load`] tries for `lib`, in order, with `env` as the environment (empty
/// values count as unset). Directories need not exist; the result is never empty.
pub fn candidates(lib: CudaLib, env: &dyn Fn(&str) -> Option<OsString>) -> Vec<Candidate> {
    let var = |k: &str| env(k).filter(|v| !v.is_empty());
    let mut out = Vec::new();
    if let Some(dirs) = var(LIB_DIR_ENV) {
        for d in std::env::split_paths(&dirs).filter(|d| !d.as_os_str().is_empty()) {
            out.push(Candidate::file(&d, lib, LIB_DIR_ENV));
        }
    }
    let loader = |out: &mut Vec<Candidate>| {
        for n in lib.loader_names() {
            out.push(Candidate {
                path: PathBuf::from(n),
                source: "system loader path".into(),
            });
        }
    };
    match lib {
        CudaLib::Driver => {
            loader(&mut out);
            for d in ["/usr/local/nvidia/lib64", "/usr/lib/wsl/lib"] {
                out.push(Candidate::file(Path::new(d), lib, "driver directory"));
            }
        }
        CudaLib::Nvrtc | CudaLib::CublasLt => {
            for k in ["CUDA_HOME", "CUDA_PATH"] {
                if let Some(root) = var(k) {
                    let root = PathBuf::from(root);
                    for sub in ["lib64", "lib", &format!("targets/{TARGET_DIR}/lib")] {
                        out.push(Candidate::file(&root.join(sub), lib, format!("${k}")));
                    }
                }
            }
            out.push(Candidate::file(
                Path::new("/usr/local/cuda/lib64"),
                lib,
                "/usr/local/cuda",
            ));
            for d in versioned_toolkits(Path::new("/usr/local")) {
                out.push(Candidate::file(
                    &d.join("lib64"),
                    lib,
                    "/usr/local/cuda-13*",
                ));
            }
            for k in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
                if let Some(prefix) = var(k) {
                    for d in pip_lib_dirs(Path::new(&prefix)) {
                        out.push(Candidate::file(&d, lib, format!("pip nvidia/cu13 (${k})")));
                    }
                }
            }
            loader(&mut out);
        }
    }
    out
}

/// `parent/cuda-13` and `parent/cuda-13.<minor>` that exist, newest first.
pub fn versioned_toolkits(parent: &Path) -> Vec<PathBuf> {
    let exact = format!("cuda-{CUDA_MAJOR}");
    let prefix = format!("cuda-{CUDA_MAJOR}.");
    let mut found: Vec<(Vec<u32>, PathBuf)> = read_dir_names(parent)
        .into_iter()
        .filter(|n| *n == exact || n.starts_with(&prefix))
        .map(|n| {
            let version = n["cuda-".len()..]
                .split('.')
                .map(|p| p.parse().unwrap_or(0))
                .collect();
            (version, parent.join(n))
        })
        .collect();
    found.sort_by(|a, b| b.cmp(a));
    found.into_iter().map(|(_, p)| p).collect()
}

/// `prefix/lib/python3.*/site-packages/nvidia/cu13/lib` for each python3.* under `prefix/lib`
/// (pip's nvidia-cuda-nvrtc wheel), newest name first.
fn pip_lib_dirs(prefix: &Path) -> Vec<PathBuf> {
    let lib = prefix.join("lib");
    let mut pythons: Vec<String> = read_dir_names(&lib)
        .into_iter()
        .filter(|n| n.starts_with("python3"))
        .collect();
    pythons.sort_by(|a, b| b.cmp(a));
    pythons
        .into_iter()
        .map(|p| {
            lib.join(p)
                .join(format!("site-packages/nvidia/cu{CUDA_MAJOR}/lib"))
        })
        .collect()
}

fn read_dir_names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The first candidate `open` accepts. An absolute path that is not a file is rejected
/// without calling `open`. When none opens: every candidate with why it was rejected.
pub fn open_first<H>(
    cands: &[Candidate],
    mut open: impl FnMut(&Candidate) -> std::result::Result<H, String>,
) -> std::result::Result<(&Candidate, H), Vec<(&Candidate, String)>> {
    let mut tried = Vec::with_capacity(cands.len());
    for c in cands {
        if !c.on_loader_path() && !c.path.is_file() {
            tried.push((c, "no such file".to_string()));
            continue;
        }
        match open(c) {
            Ok(h) => return Ok((c, h)),
            Err(why) => tried.push((c, why)),
        }
    }
    Err(tried)
}

/// The environment variables [`candidates`] reads for `lib`.
pub fn env_vars(lib: CudaLib) -> &'static [&'static str] {
    match lib {
        CudaLib::Driver => &[LIB_DIR_ENV],
        CudaLib::Nvrtc | CudaLib::CublasLt => &[
            LIB_DIR_ENV,
            "CUDA_HOME",
            "CUDA_PATH",
            "VIRTUAL_ENV",
            "CONDA_PREFIX",
        ],
    }
}

/// The error of a failed search: what is missing, advice, every place tried (one a line,
/// with why it failed), then the variables that were `unset` (so added no place).
pub fn not_found_message(lib: CudaLib, tried: &[(&Candidate, String)], unset: &[&str]) -> String {
    let mut m = format!(
        "{} ({}) not found: {}. Tried:",
        lib.label(),
        lib.file_name(),
        lib.advice()
    );
    for (c, why) in tried {
        // dlerror repeats the name: "libnvrtc.so.13: cannot open shared object file: ..."
        let name = format!("{}: ", c.path.display());
        let why = why.strip_prefix(&name).unwrap_or(why);
        m.push_str(&format!("\n  {} [{}]: {why}", c.path.display(), c.source));
    }
    if !unset.is_empty() {
        m.push_str(&format!("\n  (not set: {})", unset.join(", ")));
    }
    m
}

/// A library [`load`] made available to cudarc.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loaded {
    /// The file cudarc calls into (from dladdr).
    pub path: PathBuf,
    /// The search entry that found it (see [`Candidate::source`]).
    pub source: String,
}

type Outcome = std::result::Result<Loaded, String>;
static DRIVER: OnceLock<Outcome> = OnceLock::new();
static NVRTC: OnceLock<Outcome> = OnceLock::new();
static CUBLASLT: OnceLock<Outcome> = OnceLock::new();

fn cell(lib: CudaLib) -> &'static OnceLock<Outcome> {
    match lib {
        CudaLib::Driver => &DRIVER,
        CudaLib::Nvrtc => &NVRTC,
        CudaLib::CublasLt => &CUBLASLT,
    }
}

/// Loads `lib` once per process (the search runs on the first call; later calls return its
/// outcome). Err: `NoDevice` for the driver, `Unsupported` for NVRTC and cuBLASLt, naming every
/// place tried.
pub fn load(lib: CudaLib) -> Result<&'static Loaded> {
    cell(lib)
        .get_or_init(|| load_uncached(lib))
        .as_ref()
        .map_err(|m| Error::new(lib.missing_status(), m.clone()))
}

/// What [`load`] found for `lib`, if it has run and succeeded (never starts a search).
pub fn loaded(lib: CudaLib) -> Option<&'static Loaded> {
    cell(lib).get()?.as_ref().ok()
}

/// [`Loaded::source`] of a library the process held before [`load`] ran (loaded by the host,
/// e.g. PyTorch, or through LD_PRELOAD).
pub const ALREADY_LOADED: &str = "already loaded in this process";

fn load_uncached(lib: CudaLib) -> std::result::Result<Loaded, String> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    // A copy already in the process is what cudarc's soname lookup returns anyway (glibc
    // matches the first object loaded with that soname), and a second driver would not share
    // the host's contexts and pointers: use it, before any search.
    let (chosen, handle) = match already_loaded(lib) {
        Some(h) => (
            Candidate {
                path: PathBuf::from(lib.file_name()),
                source: ALREADY_LOADED.into(),
            },
            h,
        ),
        None => {
            let cands = candidates(lib, &env);
            let (c, h) = open_first(&cands, open).map_err(|tried| {
                let unset: Vec<&str> = env_vars(lib)
                    .iter()
                    .copied()
                    .filter(|k| env(k).is_none())
                    .collect();
                not_found_message(lib, &tried, &unset)
            })?;
            (c.clone(), h)
        }
    };
    let sym = lib.probe_symbol();
    // SAFETY: `handle` is a live dlopen handle (never closed).
    let ours = unsafe { libc::dlsym(handle, sym.as_ptr()) };
    let theirs = cudarc_symbol(lib).ok_or_else(|| {
        format!(
            "{} was loaded from {} but cudarc could not open it (is its soname {}?)",
            lib.label(),
            chosen.path.display(),
            lib.file_name()
        )
    })?;
    let path = file_of(theirs).unwrap_or_else(|| chosen.path.clone());
    let source = if theirs != ours {
        crate::log::warn(&format!(
            "{}: found {} [{}], but cudarc opened {} first (it tries `{}` on the system loader \
             path before `{}`); using that one",
            lib.label(),
            chosen.path.display(),
            chosen.source,
            path.display(),
            lib.loader_names()[1],
            lib.file_name()
        ));
        "system loader path (cudarc's choice)".to_string()
    } else {
        chosen.source
    };
    if lib == CudaLib::Nvrtc {
        load_builtins_beside(&path);
    }
    // Warn only when the override holds this library but another copy is used (it often
    // holds NVRTC alone, and then the driver comes from the loader path as it should).
    let offered =
        |d: &OsString| std::env::split_paths(d).any(|x| x.join(lib.file_name()).is_file());
    if let Some(dirs) = env(LIB_DIR_ENV).filter(|d| offered(d) && !inside(&path, d)) {
        crate::log::warn(&format!(
            "{}: {LIB_DIR_ENV}={} not used: {} [{source}]",
            lib.label(),
            dirs.to_string_lossy(),
            path.display()
        ));
    } else {
        crate::log::info(&format!("{}: {} [{source}]", lib.label(), path.display()));
    }
    Ok(Loaded { path, source })
}

/// A handle to `lib` if the process already holds it (dlopen with RTLD_NOLOAD by soname).
fn already_loaded(lib: CudaLib) -> Option<*mut c_void> {
    let name = CString::new(lib.file_name()).ok()?;
    // SAFETY: NUL-terminated name; RTLD_NOLOAD never loads anything.
    let h = unsafe {
        libc::dlopen(
            name.as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NOLOAD,
        )
    };
    (!h.is_null()).then_some(h)
}

/// dlopens a candidate. The handle is never closed.
fn open(c: &Candidate) -> std::result::Result<*mut c_void, String> {
    dlopen(&c.path)
}

/// Loads the NVRTC builtins (`libnvrtc-builtins.so.13.<minor>`) found beside `nvrtc`, so that
/// NVRTC's own plain-name dlopen of them finds them loaded (see the module header).
fn load_builtins_beside(nvrtc: &Path) {
    let Some(dir) = nvrtc.parent().filter(|d| d.is_absolute()) else {
        return;
    };
    let prefix = format!("libnvrtc-builtins.so.{CUDA_MAJOR}.");
    for n in read_dir_names(dir)
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
    {
        if let Err(e) = dlopen(&dir.join(&n)) {
            crate::log::warn(&format!("NVRTC builtins {n} did not load: {e}"));
        }
    }
}

/// Is `file` inside one of the `:`-separated `dirs` (symlinks resolved)?
fn inside(file: &Path, dirs: &OsString) -> bool {
    let real = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let file = real(file);
    std::env::split_paths(dirs).any(|d| !d.as_os_str().is_empty() && file.starts_with(real(&d)))
}

fn dlopen(path: &Path) -> std::result::Result<*mut c_void, String> {
    let cpath =
        CString::new(path.as_os_str().as_bytes()).map_err(|_| "path contains NUL".to_string())?;
    // SAFETY: NUL-terminated path; running the library's initializers is what we want.
    let h = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Err(dlerror());
    }
    Ok(h)
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated thread-local string.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "dlopen failed".into()
    } else {
        // SAFETY: non-NULL, NUL-terminated.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// The address cudarc resolves `lib`'s probe symbol to (loading the library through cudarc
/// now); None if cudarc cannot open it (its loader panics then).
fn cudarc_symbol(lib: CudaLib) -> Option<*mut c_void> {
    let name = lib.probe_symbol().to_bytes_with_nul();
    std::panic::catch_unwind(|| {
        // SAFETY: only opens the library and looks up one symbol's address.
        let l = unsafe {
            match lib {
                CudaLib::Driver => cudarc::driver::sys::culib(),
                CudaLib::Nvrtc => cudarc::nvrtc::sys::culib(),
                CudaLib::CublasLt => cudarc::cublaslt::sys::culib(),
            }
        };
        // SAFETY: the symbol is read as a plain address, never called here.
        unsafe { l.get::<*mut c_void>(name) }.ok().map(|s| *s)
    })
    .ok()
    .flatten()
}

/// The file holding the code at `addr`, as the loader names it.
fn file_of(addr: *mut c_void) -> Option<PathBuf> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables and fills `info`.
    if addr.is_null() || unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is NUL-terminated, owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let d = std::env::temp_dir()
                .join(format!("dsv4-libs-{tag}-{}-{nanos}", std::process::id()));
            std::fs::create_dir_all(&d).unwrap();
            TempDir(d)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn env_of(pairs: &[(&str, &Path)]) -> impl Fn(&str) -> Option<OsString> + use<> {
        let m: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_os_str().to_owned()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn index_of(c: &[Candidate], path: &str) -> usize {
        c.iter()
            .position(|c| c.path == Path::new(path))
            .unwrap_or_else(|| panic!("{path} not in {c:#?}"))
    }

    #[test]
    fn override_dir_is_found_first() {
        let dir = TempDir::new("override");
        let fake = dir.0.join("libnvrtc.so.13");
        std::fs::write(&fake, b"").unwrap();
        let home = TempDir::new("home");
        std::fs::create_dir_all(home.0.join("lib64")).unwrap();
        std::fs::write(home.0.join("lib64/libnvrtc.so.13"), b"").unwrap();
        let env = env_of(&[(LIB_DIR_ENV, &dir.0), ("CUDA_HOME", &home.0)]);
        let c = candidates(CudaLib::Nvrtc, &env);
        assert_eq!(c[0].path, fake);
        assert_eq!(c[0].source, LIB_DIR_ENV);
        // The fake opener stands in for dlopen (an empty file is no library).
        let mut opened = Vec::new();
        let (chosen, ()) = open_first(&c, |c| {
            opened.push(c.path.clone());
            Ok(())
        })
        .unwrap();
        assert_eq!(chosen.path, fake);
        assert_eq!(
            opened,
            std::slice::from_ref(&fake),
            "nothing after the first hit is tried"
        );
        // Without the override, $CUDA_HOME's copy is the first file that exists.
        let env = env_of(&[("CUDA_HOME", &home.0)]);
        let c = candidates(CudaLib::Nvrtc, &env);
        let (chosen, ()) = open_first(&c, |_| Ok(())).unwrap();
        assert_eq!(chosen.path, home.0.join("lib64/libnvrtc.so.13"));
        assert_eq!(chosen.source, "$CUDA_HOME");
    }

    #[test]
    fn nvrtc_search_order() {
        let venv = TempDir::new("venv");
        std::fs::create_dir_all(venv.0.join("lib/python3.12")).unwrap();
        let env = env_of(&[
            (LIB_DIR_ENV, Path::new("/a:/b")),
            ("CUDA_HOME", Path::new("/home-cuda")),
            ("CUDA_PATH", Path::new("/path-cuda")),
            ("VIRTUAL_ENV", &venv.0),
            ("CONDA_PREFIX", Path::new("")), // empty = unset
        ]);
        let c = candidates(CudaLib::Nvrtc, &env);
        let pip = venv
            .0
            .join("lib/python3.12/site-packages/nvidia/cu13/lib/libnvrtc.so.13");
        let order = [
            "/a/libnvrtc.so.13",
            "/b/libnvrtc.so.13",
            "/home-cuda/lib64/libnvrtc.so.13",
            "/home-cuda/lib/libnvrtc.so.13",
            &format!("/home-cuda/targets/{TARGET_DIR}/lib/libnvrtc.so.13"),
            "/path-cuda/lib64/libnvrtc.so.13",
            "/path-cuda/lib/libnvrtc.so.13",
            "/usr/local/cuda/lib64/libnvrtc.so.13",
            pip.to_str().unwrap(),
            "libnvrtc.so.13",
            "libnvrtc.so",
        ];
        let at: Vec<usize> = order.iter().map(|p| index_of(&c, p)).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{c:#?}");
        assert_eq!(at[0], 0);
        assert_eq!(
            *at.last().unwrap(),
            c.len() - 1,
            "the loader path comes last"
        );
        assert!(c[at[order.len() - 2]].on_loader_path());
        // /usr/local/cuda-13* entries (whatever this machine has) sit between the two.
        for (i, x) in c.iter().enumerate() {
            if x.source == "/usr/local/cuda-13*" {
                assert!(at[7] < i && i < at[8]);
            }
        }
    }

    #[test]
    fn cublaslt_is_searched_like_nvrtc() {
        let env = env_of(&[
            (LIB_DIR_ENV, Path::new("/a")),
            ("CUDA_HOME", Path::new("/home-cuda")),
        ]);
        let c = candidates(CudaLib::CublasLt, &env);
        let n = candidates(CudaLib::Nvrtc, &env);
        assert_eq!(c.len(), n.len());
        for (x, y) in c.iter().zip(&n) {
            assert_eq!(x.source, y.source);
            assert_eq!(x.path.parent(), y.path.parent());
        }
        assert_eq!(c[0].path, Path::new("/a/libcublasLt.so.13"));
        let last: Vec<&Path> = c[c.len() - 2..].iter().map(|c| c.path.as_path()).collect();
        assert_eq!(
            last,
            [Path::new("libcublasLt.so.13"), Path::new("libcublasLt.so")]
        );
        let msg = not_found_message(CudaLib::CublasLt, &[], &[]);
        assert!(
            msg.starts_with("cuBLASLt (libcublasLt.so.13) not found"),
            "{msg}"
        );
    }

    #[test]
    fn driver_search_order() {
        let env = env_of(&[
            (LIB_DIR_ENV, Path::new("/drv")),
            ("CUDA_HOME", Path::new("/home-cuda")),
        ]);
        let c = candidates(CudaLib::Driver, &env);
        let paths: Vec<&Path> = c.iter().map(|c| c.path.as_path()).collect();
        assert_eq!(
            paths,
            [
                "/drv/libcuda.so.1",
                "libcuda.so.1",
                "libcuda.so",
                "/usr/local/nvidia/lib64/libcuda.so.1",
                "/usr/lib/wsl/lib/libcuda.so.1",
            ]
            .map(Path::new),
            "never a toolkit directory (its libcuda is a stub)"
        );
        let none = candidates(CudaLib::Driver, &|_| None);
        assert_eq!(none[0].path, Path::new("libcuda.so.1"));
    }

    #[test]
    fn not_found_names_every_place() {
        let empty = TempDir::new("empty");
        let env = env_of(&[(LIB_DIR_ENV, &empty.0), ("CUDA_PATH", Path::new("/nope"))]);
        let c = candidates(CudaLib::Nvrtc, &env);
        let mut calls = 0;
        // Whatever exists on this machine, refuse it: the message must list everything.
        let tried = open_first(&c, |_| -> std::result::Result<(), String> {
            calls += 1;
            Err("refused by the test".into())
        })
        .unwrap_err();
        assert_eq!(tried.len(), c.len());
        assert!(calls >= 2, "the two loader-path names are always tried");
        let msg = not_found_message(CudaLib::Nvrtc, &tried, &["CUDA_HOME"]);
        assert!(msg.starts_with("NVRTC (libnvrtc.so.13) not found"), "{msg}");
        assert!(msg.contains(LIB_DIR_ENV) && msg.contains("nvidia-cuda-nvrtc==13.0.88"));
        for x in &c {
            assert!(
                msg.contains(&format!("\n  {} [{}]: ", x.path.display(), x.source)),
                "{} missing from:\n{msg}",
                x.path.display()
            );
        }
        assert!(msg.contains(&format!(
            "{}/libnvrtc.so.13 [{LIB_DIR_ENV}]: no such file",
            empty.0.display()
        )));
        assert!(msg.contains("libnvrtc.so [system loader path]: refused by the test"));
        assert!(msg.ends_with("\n  (not set: CUDA_HOME)"), "{msg}");
        let drv = not_found_message(CudaLib::Driver, &[], &[]);
        assert!(drv.starts_with("CUDA driver library (libcuda.so.1) not found"));
    }

    #[test]
    fn versioned_toolkits_newest_first() {
        let d = TempDir::new("local");
        for n in [
            "cuda",
            "cuda-12.8",
            "cuda-13",
            "cuda-13.0",
            "cuda-13.10",
            "cuda-13.2",
            "cuda-130",
        ] {
            std::fs::create_dir_all(d.0.join(n)).unwrap();
        }
        let names: Vec<String> = versioned_toolkits(&d.0)
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["cuda-13.10", "cuda-13.2", "cuda-13.0", "cuda-13"]);
        assert!(versioned_toolkits(&d.0.join("missing")).is_empty());
    }
}
