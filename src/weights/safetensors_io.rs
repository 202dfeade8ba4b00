//! Opening a safetensors checkpoint: locate its files (sharded index, single file, or a
//! directory of shards), memory-map them, parse and validate every header, and expose one
//! flat table of tensors (name, file, dtype, shape, byte range).
//!
//! Nothing here interprets names or dtypes: that is `names.rs` / `load.rs`. The contract is
//! that after [`Checkpoint::open`] succeeds every tensor's bytes lie inside its mapping and
//! have exactly `numel * dtype size` bytes, so later slicing cannot panic. Any byte pattern
//! in any file yields an error, never a panic.
//!
//! Errors: a missing file -> `Status::Io` naming the path; a malformed index, header or
//! offsets -> `Status::Format` naming the file; a tensor present in two files, or an index
//! entry pointing to a file that lacks the tensor -> `Status::Tensor` naming both.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Component, Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::error::{Error, Result, Status};

/// Name of the standard sharded-checkpoint index.
pub const INDEX_NAME: &str = "model.safetensors.index.json";

/// One memory-mapped safetensors file.
pub struct ShardFile {
    pub path: PathBuf,
    map: Mmap,
}

/// One tensor of the checkpoint: where its bytes are and how the header describes them.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub name: String,
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte range inside the file's mapping.
    start: usize,
    end: usize,
}

impl TensorEntry {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn byte_len(&self) -> usize {
        self.end - self.start
    }
}

/// Every tensor of a checkpoint, with its files kept mapped for the lifetime of this value.
pub struct Checkpoint {
    /// What was opened (directory, index or file), for messages.
    pub source: PathBuf,
    files: Vec<ShardFile>,
    /// Sorted by (file, offset): sequential access per file when loading.
    tensors: Vec<TensorEntry>,
    by_name: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens a checkpoint directory (sharded index, `model.safetensors`, or every
    /// `*.safetensors` in it), an index JSON, or a single safetensors file.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let meta = std::fs::metadata(path).map_err(|e| {
            Error::new(
                Status::Io,
                format!("cannot open checkpoint `{}`: {e}", path.display()),
            )
        })?;
        if meta.is_dir() {
            let index = path.join(INDEX_NAME);
            if index.is_file() {
                return Self::open_index(path, &index);
            }
            let single = path.join("model.safetensors");
            if single.is_file() {
                return Self::open_files(path, vec![single]);
            }
            let (indexes, files) = list_dir(path)?;
            match indexes.len() {
                0 => {}
                1 => return Self::open_index(path, &indexes[0]),
                _ => crate::bail!(
                    Format,
                    "checkpoint directory `{}` has several *.safetensors.index.json files and no {INDEX_NAME}: {}",
                    path.display(),
                    indexes
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
            if files.is_empty() {
                crate::bail!(
                    Io,
                    "checkpoint directory `{}` holds no *.safetensors file",
                    path.display()
                );
            }
            if files.len() > 1 {
                crate::log::info(&format!(
                    "checkpoint `{}`: no index; reading all {} *.safetensors files",
                    path.display(),
                    files.len()
                ));
            }
            return Self::open_files(path, files);
        }
        if path.to_string_lossy().ends_with(".json") {
            let dir = path.parent().unwrap_or(Path::new("."));
            return Self::open_index(dir, path);
        }
        Self::open_files(path, vec![path.to_path_buf()])
    }

    /// Opens the shards an index names and checks the index against their headers.
    fn open_index(dir: &Path, index: &Path) -> Result<Checkpoint> {
        let weight_map = read_index(index)?;
        // Shards in first-appearance order of the sorted names: deterministic.
        let mut shard_names: Vec<&str> = weight_map.values().map(String::as_str).collect();
        shard_names.sort_unstable();
        shard_names.dedup();
        let mut paths = Vec::with_capacity(shard_names.len());
        for s in &shard_names {
            let p = dir.join(s);
            if !p.is_file() {
                crate::bail!(
                    Io,
                    "shard `{}` named by index `{}` does not exist",
                    p.display(),
                    index.display()
                );
            }
            paths.push(p);
        }
        let ck = Self::open_files(index, paths)?;
        let shard_of: HashMap<&str, usize> = shard_names
            .iter()
            .enumerate()
            .map(|(i, s)| (*s, i))
            .collect();
        // Every index entry must point to the file that really holds the tensor.
        let mut names: Vec<(&String, &String)> = weight_map.iter().collect();
        names.sort_unstable();
        for (name, shard) in names {
            let want = shard_of[shard.as_str()];
            match ck.by_name.get(name) {
                Some(&t) if ck.tensors[t].file == want => {}
                found => {
                    let also = match found {
                        Some(&t) => format!(
                            " (it is in `{}`)",
                            ck.files[ck.tensors[t].file].path.display()
                        ),
                        None => String::new(),
                    };
                    crate::bail!(
                        Tensor,
                        "index `{}` maps tensor `{name}` to file `{}`, which does not contain it{also}",
                        index.display(),
                        ck.files[want].path.display()
                    );
                }
            }
        }
        // Tensors the index does not list are still loaded (the files are the truth), but say so.
        let unlisted = ck
            .tensors
            .iter()
            .filter(|t| !weight_map.contains_key(&t.name))
            .count();
        if unlisted > 0 {
            let first = ck
                .tensors
                .iter()
                .find(|t| !weight_map.contains_key(&t.name))
                .map(|t| t.name.clone());
            crate::log::warn(&format!(
                "index `{}` does not list {unlisted} tensor(s) present in its shards (first: `{}`); reading them anyway",
                index.display(),
                first.unwrap_or_default()
            ));
        }
        Ok(ck)
    }

    /// Maps and parses `paths`; a tensor name found in two files is an error.
    fn open_files(source: &Path, paths: Vec<PathBuf>) -> Result<Checkpoint> {
        let mut files = Vec::with_capacity(paths.len());
        let mut tensors: Vec<TensorEntry> = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        for (fi, path) in paths.into_iter().enumerate() {
            let map = map_file(&path)?;
            let mut entries = parse_header(&map, &path)?;
            entries.sort_by_key(|e| e.start);
            for mut e in entries {
                e.file = fi;
                if let Some(&prev) = by_name.get(&e.name) {
                    // Names are unique within one header, so `prev` is in an earlier file.
                    let other: &ShardFile = &files[tensors[prev].file];
                    crate::bail!(
                        Tensor,
                        "tensor `{}` appears in two files: `{}` and `{}`",
                        e.name,
                        other.path.display(),
                        path.display()
                    );
                }
                by_name.insert(e.name.clone(), tensors.len());
                tensors.push(e);
            }
            files.push(ShardFile { path, map });
        }
        Ok(Checkpoint {
            source: source.to_path_buf(),
            files,
            tensors,
            by_name,
        })
    }

    pub fn files(&self) -> &[ShardFile] {
        &self.files
    }

    pub fn tensors(&self) -> &[TensorEntry] {
        &self.tensors
    }

    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// Path of the file holding `t`.
    pub fn path_of(&self, t: &TensorEntry) -> &Path {
        &self.files[t.file].path
    }

    /// The raw little-endian bytes of `t` (validated at open: always in range).
    pub fn data(&self, t: &TensorEntry) -> &[u8] {
        &self.files[t.file].map[t.start..t.end]
    }
}

/// Lists `*.safetensors.index.json` and `*.safetensors` files of `dir`, sorted by name.
fn list_dir(dir: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let rd = std::fs::read_dir(dir).map_err(|e| {
        Error::new(
            Status::Io,
            format!("cannot list checkpoint directory `{}`: {e}", dir.display()),
        )
    })?;
    let (mut idx, mut files) = (Vec::new(), Vec::new());
    for ent in rd {
        let ent = ent
            .map_err(|e| Error::new(Status::Io, format!("cannot list `{}`: {e}", dir.display())))?;
        let p = ent.path();
        let name = ent.file_name().to_string_lossy().into_owned();
        if !p.is_file() {
            continue;
        }
        if name.ends_with(".safetensors.index.json") {
            idx.push(p);
        } else if name.ends_with(".safetensors") {
            files.push(p);
        }
    }
    idx.sort();
    files.sort();
    Ok((idx, files))
}

/// Reads and validates an index's `weight_map` (tensor name -> relative shard file name).
fn read_index(index: &Path) -> Result<HashMap<String, String>> {
    let text = std::fs::read_to_string(index).map_err(|e| {
        Error::new(
            Status::Io,
            format!("cannot read index `{}`: {e}", index.display()),
        )
    })?;
    let fmt = |what: String| {
        Error::new(
            Status::Format,
            format!("index `{}`: {what}", index.display()),
        )
    };
    let v: Value = serde_json::from_str(&text).map_err(|e| fmt(format!("not valid JSON: {e}")))?;
    let wm = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| fmt("no `weight_map` object".into()))?;
    if wm.is_empty() {
        return Err(fmt("`weight_map` is empty".into()));
    }
    let mut out = HashMap::with_capacity(wm.len());
    for (name, shard) in wm {
        let s = shard.as_str().ok_or_else(|| {
            fmt(format!(
                "`weight_map[\"{name}\"]` must be a file name string, got {shard}"
            ))
        })?;
        // Shards must live under the index's directory: no absolute paths, no `..`.
        let rel = Path::new(s);
        let ok = !s.is_empty() && rel.components().all(|c| matches!(c, Component::Normal(_)));
        if !ok {
            return Err(fmt(format!(
                "`weight_map[\"{name}\"]` = \"{s}\" must be a relative file name inside the checkpoint directory"
            )));
        }
        out.insert(name.clone(), s.to_owned());
    }
    Ok(out)
}

fn map_file(path: &Path) -> Result<Mmap> {
    let io = |e: std::io::Error| {
        Error::new(Status::Io, format!("cannot read `{}`: {e}", path.display()))
    };
    let f = File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    if len < 8 {
        crate::bail!(
            Format,
            "`{}` is not a safetensors file: {len} bytes, shorter than the 8-byte header length",
            path.display()
        );
    }
    // SAFETY: the mapping is read-only and private to this process. Another process
    // truncating the file while it is mapped would fault on access (as with any mmap-based
    // reader); dsv4 documents that checkpoints must not change during a load.
    unsafe { Mmap::map(&f) }.map_err(io)
}

/// Drops the whole pages of `bytes` (part of a checkpoint mapping, already consumed) from
/// this process's resident memory (madvise DONTNEED). The mapping stays valid: a later read
/// faults the pages back in from the file, with the same bytes (the mapping is read-only, so
/// no page of it was ever written). A load then costs the page cache, not the engine's RSS,
/// a checkpoint's size. Only for slices of a [`Checkpoint`]'s mappings; best effort.
pub fn release_pages(bytes: &[u8]) {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let start = (bytes.as_ptr() as usize).div_ceil(page) * page;
        let end = (bytes.as_ptr() as usize + bytes.len()) / page * page;
        if end > start {
            // SAFETY: [start, end) lies inside `bytes`, a read-only file mapping (see above).
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        }
    }
}

/// Rejects data offsets past the end of the file before the `safetensors` crate sees them:
/// it sums offsets and the header length unchecked, which a hostile header can overflow
/// (a panic in debug builds). Anything else malformed is left to the crate to report.
fn precheck_offsets(buf: &[u8], path: &Path) -> Result<()> {
    let Some(n) = buf
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    else {
        return Ok(());
    };
    let Some(header) = usize::try_from(n)
        .ok()
        .and_then(|n| buf.get(8..8usize.checked_add(n)?))
    else {
        return Ok(());
    };
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(header) else {
        return Ok(());
    };
    let data_len = (buf.len() - 8 - header.len()) as u64;
    for (name, info) in &map {
        let end = info
            .get("data_offsets")
            .and_then(|o| o.get(1))
            .and_then(Value::as_u64);
        if let Some(end) = end.filter(|&e| e > data_len) {
            crate::bail!(
                Format,
                "`{}` is not a valid safetensors file: data offsets of tensor `{name}` end at byte {end}, past the {data_len} data bytes of the file",
                path.display()
            );
        }
    }
    Ok(())
}

/// Parses one file's header with the `safetensors` crate and returns absolute byte ranges.
fn parse_header(buf: &[u8], path: &Path) -> Result<Vec<TensorEntry>> {
    let fmt = |what: String| {
        Error::new(
            Status::Format,
            format!(
                "`{}` is not a valid safetensors file: {what}",
                path.display()
            ),
        )
    };
    precheck_offsets(buf, path)?;
    // Backstop: the crate adds lengths unchecked in one place (see `precheck_offsets`); a
    // panic there must become an error, not unwind into the host.
    let parsed = std::panic::catch_unwind(|| SafeTensors::read_metadata(buf))
        .map_err(|_| fmt("header arithmetic overflows".into()))?;
    let (n, metadata) = parsed.map_err(|e| fmt(e.to_string()))?;
    let data_start = 8usize
        .checked_add(n)
        .ok_or_else(|| fmt("header length overflows".into()))?;
    let mut out = Vec::with_capacity(metadata.tensors().len());
    for (name, info) in metadata.tensors() {
        let (s, e) = info.data_offsets;
        // Re-check everything we later rely on, with checked arithmetic.
        let start = data_start.checked_add(s);
        let end = data_start.checked_add(e);
        let (Some(start), Some(end)) = (start, end) else {
            return Err(fmt(format!("data offsets of tensor `{name}` overflow")));
        };
        if start > end || end > buf.len() {
            return Err(fmt(format!(
                "data offsets [{s}, {e}) of tensor `{name}` lie outside the file ({} data bytes)",
                buf.len() - data_start.min(buf.len())
            )));
        }
        let bits = info
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(info.dtype.bitsize()));
        if bits != Some((end - start) * 8) {
            return Err(fmt(format!(
                "tensor `{name}`: {} bytes for dtype {} shape {:?}",
                end - start,
                info.dtype,
                info.shape
            )));
        }
        out.push(TensorEntry {
            name,
            file: 0,
            dtype: info.dtype,
            shape: info.shape.clone(),
            start,
            end,
        });
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    /// A fresh empty directory under the system temp dir (removed by the caller's guard).
    pub(crate) struct TempDir(pub PathBuf);

    impl TempDir {
        pub(crate) fn new(tag: &str) -> TempDir {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "dsv4-st-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn bytes_of(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    fn sample() -> Vec<u8> {
        bytes_of(&[
            ("a", Dtype::F32, vec![2, 3], (0..24).collect()),
            ("b", Dtype::BF16, vec![5], (0..10).collect()),
            ("c", Dtype::I64, vec![1, 2], (0..16).collect()),
            ("d", Dtype::F8_E8M0, vec![3], vec![1, 2, 3]),
        ])
    }

    #[test]
    fn single_file_and_dir() {
        let d = TempDir::new("single");
        let f = d.0.join("model.safetensors");
        std::fs::write(&f, sample()).unwrap();
        for p in [&f, &d.0] {
            let ck = Checkpoint::open(p).unwrap();
            assert_eq!(ck.tensors().len(), 4);
            let a = ck.get("a").unwrap();
            assert_eq!((a.dtype, a.shape.clone()), (Dtype::F32, vec![2, 3]));
            assert_eq!(ck.data(a), (0..24).collect::<Vec<u8>>());
            assert_eq!(ck.data(ck.get("d").unwrap()), [1, 2, 3]);
        }
        // A directory with one arbitrarily named file also works.
        let d2 = TempDir::new("single2");
        std::fs::write(d2.0.join("weights.safetensors"), sample()).unwrap();
        assert_eq!(Checkpoint::open(&d2.0).unwrap().tensors().len(), 4);
    }

    #[test]
    fn missing_paths_are_io_errors() {
        let d = TempDir::new("missing");
        let e = Checkpoint::open(&d.0.join("nope.safetensors"))
            .err()
            .unwrap();
        assert_eq!(e.status, Status::Io);
        assert!(e.message.contains("nope.safetensors"), "{}", e.message);
        let e = Checkpoint::open(&d.0).err().unwrap();
        assert_eq!(e.status, Status::Io, "{}", e.message);
    }

    #[test]
    fn sharded_index() {
        let d = TempDir::new("shards");
        let s1 = bytes_of(&[
            ("x", Dtype::F32, vec![2], vec![0; 8]),
            ("y", Dtype::F32, vec![1], vec![1; 4]),
        ]);
        let s2 = bytes_of(&[("z", Dtype::BF16, vec![2], vec![2; 4])]);
        std::fs::write(d.0.join("m-1.safetensors"), &s1).unwrap();
        std::fs::write(d.0.join("m-2.safetensors"), &s2).unwrap();
        let write_index = |map: &str| {
            std::fs::write(
                d.0.join(INDEX_NAME),
                format!("{{\"metadata\":{{}},\"weight_map\":{{{map}}}}}"),
            )
            .unwrap()
        };
        write_index(r#""x":"m-1.safetensors","y":"m-1.safetensors","z":"m-2.safetensors""#);
        let ck = Checkpoint::open(&d.0).unwrap();
        assert_eq!(ck.tensors().len(), 3);
        assert!(
            ck.path_of(ck.get("z").unwrap())
                .ends_with("m-2.safetensors")
        );
        assert_eq!(
            Checkpoint::open(&d.0.join(INDEX_NAME))
                .unwrap()
                .tensors()
                .len(),
            3
        );

        // Index points to the wrong shard.
        write_index(r#""x":"m-1.safetensors","y":"m-2.safetensors","z":"m-2.safetensors""#);
        let e = Checkpoint::open(&d.0).err().unwrap();
        assert_eq!(e.status, Status::Tensor);
        assert!(
            e.message.contains("`y`") && e.message.contains("m-2.safetensors"),
            "{}",
            e.message
        );

        // Index names a missing shard.
        write_index(r#""x":"m-1.safetensors","y":"m-1.safetensors","z":"m-3.safetensors""#);
        let e = Checkpoint::open(&d.0).err().unwrap();
        assert_eq!(e.status, Status::Io);
        assert!(e.message.contains("m-3.safetensors"), "{}", e.message);

        // Escaping the directory.
        write_index(r#""x":"../m-1.safetensors""#);
        let e = Checkpoint::open(&d.0).err().unwrap();
        assert_eq!(e.status, Status::Format, "{}", e.message);

        // Malformed index.
        std::fs::write(d.0.join(INDEX_NAME), "{\"weight_map\": [1]}").unwrap();
        let e = Checkpoint::open(&d.0).err().unwrap();
        assert_eq!(e.status, Status::Format);
        assert!(e.message.contains(INDEX_NAME), "{}", e.message);

        // Duplicate tensor across shards (no index).
        std::fs::remove_file(d.0.join(INDEX_NAME)).unwrap();
        std::fs::write(d.0.join("m-2.safetensors"), &s1).unwrap();
        let e = Checkpoint::open(&d.0).err().unwrap();
        assert_eq!(e.status, Status::Tensor);
        assert!(
            e.message.contains("`x`") && e.message.contains("m-1") && e.message.contains("m-2"),
            "{}",
            e.message
        );
    }

    /// Truncating or corrupting a valid file at every offset never panics; a damaged header
    /// is a Format error naming the file.
    #[test]
    fn truncation_and_corruption_never_panic() {
        let d = TempDir::new("fuzz");
        let good = sample();
        let path = d.0.join("f.safetensors");
        for cut in 0..good.len() {
            std::fs::write(&path, &good[..cut]).unwrap();
            let e = Checkpoint::open(&path)
                .err()
                .expect("truncated file must fail");
            assert_eq!(e.status, Status::Format, "cut {cut}: {}", e.message);
            assert!(e.message.contains("f.safetensors"), "{}", e.message);
        }
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for pos in 0..good.len() {
            for &x in &[
                0x00u8,
                0xFF,
                0x22,
                0x7B,
                0x7D,
                0x30,
                0x39,
                b',',
                b'-',
                next() as u8,
            ] {
                let mut bad = good.clone();
                bad[pos] = x;
                std::fs::write(&path, &bad).unwrap();
                match Checkpoint::open(&path) {
                    Ok(ck) => {
                        // Accepted files must be self-consistent: every slice is readable.
                        for t in ck.tensors() {
                            assert_eq!(ck.data(t).len() * 8, t.numel() * t.dtype.bitsize());
                        }
                    }
                    Err(e) => {
                        assert!(matches!(e.status, Status::Format), "pos {pos}: {}", e);
                        assert!(e.message.contains("f.safetensors"), "{}", e.message);
                    }
                }
            }
        }
        // Hostile header lengths.
        for n in [u64::MAX, u64::MAX - 7, 1 << 40, 100_000_001, 0] {
            let mut bad = good.clone();
            bad[..8].copy_from_slice(&n.to_le_bytes());
            std::fs::write(&path, &bad).unwrap();
            assert_eq!(
                Checkpoint::open(&path).err().unwrap().status,
                Status::Format
            );
        }
        // Eight tensors of 2^61 - 1 bytes each: every size is valid on its own, but the
        // total plus the header length overflows usize inside the safetensors crate.
        let s = (1u64 << 61) - 1;
        let entries: Vec<String> = (0..8u64)
            .map(|k| {
                format!(
                    "\"t{k}\":{{\"dtype\":\"U8\",\"shape\":[{s}],\"data_offsets\":[{},{}]}}",
                    k * s,
                    (k + 1) * s
                )
            })
            .collect();
        let hdr = format!("{{{}}}", entries.join(","));
        let mut bad = (hdr.len() as u64).to_le_bytes().to_vec();
        bad.extend_from_slice(hdr.as_bytes());
        std::fs::write(&path, &bad).unwrap();
        assert_eq!(
            Checkpoint::open(&path).err().unwrap().status,
            Status::Format
        );
    }
}
