//! `dsv4` command line: demo | run | eval | bench, over the library's engine API.
//!
//! - `dsv4 demo` runs the embedded tiny model (dummy weights): prefill + greedy decode of a
//!   few sequences batched together, on CUDA when present, else on the CPU reference.
//! - `dsv4 run --model DIR --prompt 1,2,3 [--max-new N]`: greedy generation from token ids.
//! - `dsv4 eval --model DIR --fixture FILE`: max |dlogit| against an oracle file written by
//!   tests/fixtures/make_fixtures.py.
//! - `dsv4 bench [--model DIR] [--tokens N]`: prefill and decode timings as JSON.
//! - `dsv4 bench load [--config FILE | --model DIR] [--device ...]`: create + load + finalize
//!   times, load GB/s and host memory (bench_load.rs).
//! - `dsv4 bench refit [--config FILE]`: every weight refit from device memory, timed against
//!   the copy floor, host memory sampled, checked against a fresh load (bench_refit.rs).
//! - `dsv4 dummy-checkpoint --config FILE --out DIR`: the dummy weights as a safetensors
//!   checkpoint (dummy_checkpoint.rs).
//! - `dsv4 bench moe [--batches N,N...] [--routing uniform,skewed,topk] [--path P] [--router R]
//!   [--ids-dir DIR] [--trace DIR]`: the fast MoE layer alone at Flash shapes, one JSON line per case
//!   (bench_moe.rs). `--path` and `--router` (auto, few, tensor, tensor-split, tensor-pair) force the expert GEMMs' and the
//!   router's kernels; `--trace` (with `--defines FMOE_TRACE=1` for the decode kernels, `FMW_TRACE=1`
//!   for the prefill GEMMs) writes their per-block event log of one layer call a case (moe_trace.rs,
//!   scripts/fmoe-trace.py, scripts/fmw-trace.py).
//! - `dsv4 bench dense [--tokens N,N...] [--projection NAME] [--read-probe N,N...]
//!   [--lt-candidates N]`: the fast set's dense projections alone at Flash shapes, one JSON line
//!   per case (bench_dense.rs); `--read-probe` adds each projection's bytes read by a kernel that
//!   only reads them, at N blocks an SM; `--lt-candidates` times cuBLASLt's first N algorithms
//!   for each GEMM shape, f32 and BF16 output.
//! - `bench moe`, `bench dense` and `bench attn` take `--defines NAME[=VALUE],...`: preprocessor
//!   defines for every kernel family they compile (cached apart), so one build times several
//!   `#if` variants of a kernel in one device call (bench_util.rs).

mod bench_attn;
mod bench_dense;
mod bench_dense_chain;
mod bench_load;
mod bench_moe;
mod bench_refit;
mod bench_util;
mod dummy_checkpoint;
mod moe_trace;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use dsv4::{Batch, ConfigSource, Engine, EngineOptions, LoadFormat, LogitsOut, Numerics, Status};

const USAGE: &str = "usage:
  dsv4 demo [--device cpu|cuda[:N]]
  dsv4 run --model DIR --prompt ID,ID,... [--max-new N] [--device ...]
  dsv4 eval --model DIR --fixture ORACLE.safetensors
  dsv4 bench [--model DIR | --config FILE] [--tokens N] [--decode-steps N] [--decode-batch N[,N...]] [--graph 0|1]
              [--prefill-repeats N] [--device ...]
  dsv4 bench load [--config FILE | --model DIR] [--device ...] [--staging-mb N]
  dsv4 bench refit [--config FILE] [--device cuda[:N]]
  dsv4 dummy-checkpoint --config FILE --out DIR [--seed S]
  dsv4 bench moe [--batches N[,N...]] [--routing uniform,skewed,topk] [--path auto,decode,decode-fused,decode-routed,prefill]
                 [--router auto|few|tensor|tensor-split|tensor-pair] [--ids-dir DIR] [--trace DIR] [--device cuda[:N]]
  dsv4 bench dense [--tokens N[,N...]] [--projection NAME] [--read-probe N[,N...]] [--lt-candidates N]
                   [--device cuda[:N]]
  dsv4 bench attn [--contexts N[,N...]] [--batches N[,N...]] [--indexer-chunks N[,N...]]
                  [--device cuda[:N]]
  (bench moe, dense and attn also take --defines NAME[=VALUE][,...]: preprocessor defines for
   every kernel they compile, to time a kernel's #if variants from one build)";

struct Args {
    cmd: String,
    /// A word after the command (`bench moe`).
    sub: Option<String>,
    flags: Vec<(String, String)>,
}

impl Args {
    fn parse() -> Result<Args, String> {
        let mut it = std::env::args().skip(1);
        let cmd = it.next().ok_or(USAGE)?;
        let mut it = it.peekable();
        let sub = if cmd == "bench" {
            it.next_if(|a| !a.starts_with("--"))
        } else {
            None
        };
        let mut flags = vec![];
        while let Some(k) = it.next() {
            let key = k
                .strip_prefix("--")
                .ok_or_else(|| format!("unexpected argument `{k}`\n{USAGE}"))?;
            let v = it
                .next()
                .ok_or_else(|| format!("flag --{key} needs a value"))?;
            flags.push((key.to_string(), v));
        }
        Ok(Args { cmd, sub, flags })
    }

    fn get(&self, k: &str) -> Option<&str> {
        self.flags
            .iter()
            .find(|(f, _)| f == k)
            .map(|(_, v)| v.as_str())
    }

    fn num(&self, k: &str, default: usize) -> Result<usize, String> {
        self.get(k).map_or(Ok(default), |v| {
            v.parse()
                .map_err(|_| format!("--{k} must be a number, got `{v}`"))
        })
    }
}

fn device(args: &Args) -> Result<i32, String> {
    match args.get("device") {
        None | Some("cpu") => Ok(-1),
        Some("cuda") => Ok(0),
        Some(d) => d
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("--device must be cpu, cuda or cuda:N, got `{d}`")),
    }
}

fn main() -> ExitCode {
    let result = Args::parse().and_then(|a| match a.cmd.as_str() {
        "demo" => demo(&a),
        "run" => run(&a),
        "eval" => eval(&a),
        "bench" => bench(&a),
        "dummy-checkpoint" => dummy_checkpoint::run(&a),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown command `{other}`\n{USAGE}")),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dsv4: {e}");
            ExitCode::FAILURE
        }
    }
}

fn err(e: dsv4::Error) -> String {
    e.to_string()
}

/// Creates an engine on `device`, falling back to the CPU reference when CUDA is absent
/// (demo only) and saying so.
fn create(
    source: ConfigSource,
    mut opts: EngineOptions,
    allow_fallback: bool,
) -> Result<(Engine, String), String> {
    match Engine::create(source.clone(), opts.clone()) {
        Ok(e) => {
            let name = if opts.device < 0 {
                "CPU reference".to_string()
            } else {
                format!("CUDA device {}", opts.device)
            };
            Ok((e, name))
        }
        Err(e) if allow_fallback && matches!(e.status, Status::NoDevice | Status::Unsupported) => {
            println!(
                "CUDA unavailable ({}); using the CPU reference backend",
                e.message
            );
            opts.device = -1;
            Engine::create(source, opts)
                .map(|e| (e, "CPU reference".to_string()))
                .map_err(err)
        }
        Err(e) => Err(err(e)),
    }
}

/// Plays the host around an engine: host slices for the CPU backend; for the CUDA backend
/// the batch arrays are copied into device buffers and forward runs on our own stream.
struct Host {
    cuda: Option<(
        dsv4::cuda::context::Context,
        dsv4::cuda::stream::OwnedStream,
        dsv4::cuda::arena::Arena,
    )>,
}

impl Host {
    fn new(e: &Engine) -> Result<Host, String> {
        if !e.is_cuda() {
            return Ok(Host { cuda: None });
        }
        let ctx = dsv4::cuda::context::Context::retain(e.options().device).map_err(err)?;
        let _g = ctx.enter().map_err(err)?;
        let stream = dsv4::cuda::stream::OwnedStream::new(&ctx).map_err(err)?;
        let bytes = 8 * (1 << 20) + e.options().max_num_tokens * e.config().vocab_size * 4;
        let buf = dsv4::cuda::arena::Arena::new(&ctx, bytes).map_err(err)?;
        drop(_g);
        Ok(Host {
            cuda: Some((ctx, stream, buf)),
        })
    }

    /// One forward; `logits` receives `rows` (or every token) x vocab f32 values.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        e: &mut Engine,
        toks: &[i32],
        pos: &[i32],
        slots: &[i32],
        qs: &[i32],
        rows: Option<&[i32]>,
        logits: &mut [f32],
    ) -> Result<(), String> {
        let Some((ctx, stream, buf)) = &self.cuda else {
            return e
                .forward(&mut Batch {
                    token_ids: toks,
                    positions: pos,
                    seq_slots: slots,
                    query_start: qs,
                    logits_rows: rows,
                    logits: LogitsOut::F32(logits),
                })
                .map_err(err);
        };
        use dsv4::cuda::arena::{copy_to_device_sync, copy_to_host_sync};
        let _g = ctx.enter().map_err(err)?;
        let st = stream.borrow();
        let w = buf.whole();
        let mb = 1usize << 20;
        let part = |i: usize| w.slice(i * mb, mb).map_err(err);
        copy_to_device_sync(part(0)?, toks, st).map_err(err)?;
        copy_to_device_sync(part(1)?, pos, st).map_err(err)?;
        copy_to_device_sync(part(2)?, slots, st).map_err(err)?;
        copy_to_device_sync(part(3)?, qs, st).map_err(err)?;
        if let Some(r) = rows {
            copy_to_device_sync(part(4)?, r, st).map_err(err)?;
        }
        let out = w.slice(8 * mb, logits.len() * 4).map_err(err)?;
        let db = dsv4::engine::DeviceBatch {
            num_tokens: toks.len(),
            num_seqs: slots.len(),
            token_ids: part(0)?.addr(),
            positions: part(1)?.addr(),
            seq_slots: part(2)?.addr(),
            query_start: part(3)?.addr(),
            logits_rows: if rows.is_some() { part(4)?.addr() } else { 0 },
            num_logits: rows.map_or(toks.len(), <[i32]>::len),
            logits: out.addr(),
            logits_bf16: false,
        };
        e.forward_device(&db, st.raw() as *mut _).map_err(err)?;
        copy_to_host_sync(logits, out, st).map_err(err)
    }
}

/// What `generate` returns: the generated tokens per sequence, prefill seconds, decode
/// seconds and the number of prefill tokens.
type Generated = (Vec<Vec<i32>>, f64, f64, usize);

/// Greedy decoding for several sequences batched in one engine; returns generated tokens.
fn generate(e: &mut Engine, prompts: &[Vec<i32>], max_new: usize) -> Result<Generated, String> {
    let host = Host::new(e)?;
    let vocab = e.config().vocab_size;
    let argmax = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as i32
    };
    // Prefill: all prompts in one batch, logits of each last token only.
    let (mut toks, mut pos, mut qs, mut rows) = (vec![], vec![], vec![0i32], vec![]);
    for p in prompts {
        toks.extend_from_slice(p);
        pos.extend(0..p.len() as i32);
        qs.push(toks.len() as i32);
        rows.push(toks.len() as i32 - 1);
    }
    let slots: Vec<i32> = (0..prompts.len() as i32).collect();
    let mut logits = vec![0f32; prompts.len() * vocab];
    let t0 = Instant::now();
    host.forward(e, &toks, &pos, &slots, &qs, Some(&rows), &mut logits)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut out: Vec<Vec<i32>> = logits
        .chunks_exact(vocab)
        .map(|r| vec![argmax(r)])
        .collect();
    // Decode: one token per sequence per step.
    let t1 = Instant::now();
    for step in 1..max_new {
        let toks: Vec<i32> = out.iter().map(|o| *o.last().unwrap()).collect();
        let pos: Vec<i32> = prompts
            .iter()
            .map(|p| (p.len() + step - 1) as i32)
            .collect();
        let qs: Vec<i32> = (0..=prompts.len() as i32).collect();
        host.forward(e, &toks, &pos, &slots, &qs, None, &mut logits)?;
        logits
            .chunks_exact(vocab)
            .zip(&mut out)
            .for_each(|(r, o)| o.push(argmax(r)));
    }
    Ok((out, prefill_s, t1.elapsed().as_secs_f64(), toks.len()))
}

fn demo(a: &Args) -> Result<(), String> {
    // CUDA when a device is present, else the CPU reference (or as --device says).
    let dev = match a.get("device") {
        Some(_) => device(a)?,
        None => match dsv4::cuda::device_count() {
            Ok(n) if n > 0 => 0,
            _ => -1,
        },
    };
    let opts = EngineOptions {
        device: dev,
        max_num_seqs: 4,
        max_num_tokens: 256,
        max_seq_len: 512,
        ..Default::default()
    };
    let (mut e, backend) = create(ConfigSource::TinyDefault, opts, true)?;
    e.load(None, LoadFormat::Dummy).map_err(err)?;
    e.finalize().map_err(err)?;
    let c = e.config();
    println!(
        "dsv4 demo: embedded tiny DeepSeek-V4 ({} layers, hidden {}, {} experts top-{}, vocab {}), dummy weights, backend: {backend}",
        c.num_layers, c.hidden_size, c.n_routed_experts, c.experts_per_tok, c.vocab_size
    );
    if e.options().device >= 0 {
        // Where the CUDA libraries came from (src/cuda/libs.rs), e.g. to check a run with
        // LD_LIBRARY_PATH unset.
        use dsv4::cuda::libs::{CudaLib, loaded};
        let show = |l: CudaLib| {
            loaded(l).map_or("not loaded".into(), |x| {
                format!("{} [{}]", x.path.display(), x.source)
            })
        };
        println!(
            "CUDA libraries: driver {}; NVRTC {}; cuBLASLt {}",
            show(CudaLib::Driver),
            show(CudaLib::Nvrtc),
            show(CudaLib::CublasLt)
        );
    }
    let prompts: Vec<Vec<i32>> = [37usize, 20, 53]
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            (0..n)
                .map(|i| ((i * 31 + s * 97 + 7) % c.vocab_size) as i32)
                .collect()
        })
        .collect();
    let max_new = 24;
    let (out, prefill_s, decode_s, prefill_tokens) = generate(&mut e, &prompts, max_new)?;
    for (s, o) in out.iter().enumerate() {
        println!("  seq {s}: prompt {} tokens -> {:?}", prompts[s].len(), o);
    }
    let decoded = (max_new - 1) * prompts.len();
    println!(
        "prefill: {prefill_tokens} tokens in {:.1} ms ({:.0} tok/s); decode: {decoded} tokens in {:.1} ms ({:.0} tok/s, batch {})",
        prefill_s * 1e3,
        prefill_tokens as f64 / prefill_s,
        decode_s * 1e3,
        decoded as f64 / decode_s,
        prompts.len()
    );
    Ok(())
}

fn model_dir(a: &Args) -> Result<PathBuf, String> {
    a.get("model")
        .map(PathBuf::from)
        .ok_or_else(|| format!("--model DIR is required\n{USAGE}"))
}

fn run(a: &Args) -> Result<(), String> {
    let dir = model_dir(a)?;
    let prompt: Vec<i32> = a
        .get("prompt")
        .ok_or("--prompt ID,ID,... is required")?
        .split(',')
        .map(|t| {
            t.trim()
                .parse()
                .map_err(|_| format!("bad token id `{t}` in --prompt"))
        })
        .collect::<Result<_, _>>()?;
    let max_new = a.num("max-new", 16)?;
    let opts = EngineOptions {
        device: device(a)?,
        max_num_seqs: 1,
        max_num_tokens: prompt.len().max(1),
        max_seq_len: prompt.len() + max_new + 1,
        ..Default::default()
    };
    let (mut e, backend) = create(ConfigSource::Path(dir.clone()), opts, false)?;
    e.load(Some(&dir), LoadFormat::Auto).map_err(err)?;
    e.finalize().map_err(err)?;
    let (out, _, _, _) = generate(&mut e, &[prompt], max_new)?;
    println!("backend: {backend}");
    println!(
        "{}",
        out[0]
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    Ok(())
}

fn eval(a: &Args) -> Result<(), String> {
    let dir = model_dir(a)?;
    let fixture = a.get("fixture").ok_or("--fixture FILE is required")?;
    let bytes = std::fs::read(fixture).map_err(|e| format!("cannot read {fixture}: {e}"))?;
    let st =
        safetensors::SafeTensors::deserialize(&bytes).map_err(|e| format!("{fixture}: {e}"))?;
    let read = |n: &str| {
        st.tensor(n)
            .map(|t| t.data().to_vec())
            .map_err(|e| format!("{fixture}: {n}: {e}"))
    };
    let mut prompts = vec![];
    let mut want = vec![];
    while let Ok(p) = read(&format!("prompt.{}", prompts.len())) {
        want.push(read(&format!("logits.{}", prompts.len()))?);
        prompts.push(
            p.chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
                .collect::<Vec<i32>>(),
        );
    }
    if prompts.is_empty() {
        return Err(format!("{fixture} holds no prompt.0"));
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    let opts = EngineOptions {
        device: device(a)?,
        max_num_seqs: 1,
        max_num_tokens: longest,
        max_seq_len: longest,
        numerics: Numerics::Exact,
        ..Default::default()
    };
    let (mut e, backend) = create(ConfigSource::Path(dir.clone()), opts, false)?;
    e.load(Some(&dir), LoadFormat::Auto).map_err(err)?;
    e.finalize().map_err(err)?;
    let vocab = e.config().vocab_size;
    let mut worst = 0f32;
    for (p, w) in prompts.iter().zip(&want) {
        let pos: Vec<i32> = (0..p.len() as i32).collect();
        let mut out = vec![0f32; p.len() * vocab];
        e.forward(&mut Batch {
            token_ids: p,
            positions: &pos,
            seq_slots: &[0],
            query_start: &[0, p.len() as i32],
            logits_rows: None,
            logits: LogitsOut::F32(&mut out),
        })
        .map_err(err)?;
        let w: Vec<f32> = w
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        worst = out
            .iter()
            .zip(&w)
            .map(|(x, y)| (x - y).abs())
            .fold(worst, f32::max);
    }
    println!(
        "backend: {backend}; sequences: {}; max |dlogit| = {worst:.3e}",
        prompts.len()
    );
    Ok(())
}

/// CUDA bench: `batch` sequences prefilled together (`tokens` in total, one forward), then
/// `steps` batched decode steps; per-step wall times after stream synchronization.
/// `--decode-batch` for the CUDA bench: one size or a comma list (`1,8`), each a separate case
/// on ONE engine, so a large model is created and loaded once.
fn decode_batches(a: &Args) -> Result<Vec<usize>, String> {
    a.get("decode-batch")
        .unwrap_or("8")
        .split(',')
        .map(|v| {
            v.trim().parse::<usize>().map(|b| b.max(1)).map_err(|_| {
                format!("--decode-batch must be numbers separated by commas, got `{v}`")
            })
        })
        .collect()
}

fn bench_cuda(a: &Args, dev: i32) -> Result<(), String> {
    use dsv4::cuda::arena::{Arena, copy_to_device_sync};
    use dsv4::cuda::context::Context;
    use dsv4::cuda::stream::OwnedStream;
    use dsv4::engine::DeviceBatch;
    let tokens = a.num("tokens", 8192)?;
    let steps = a.num("decode-steps", 16)?.max(1);
    let batches = decode_batches(a)?;
    // --graph 1: also time decode steps replayed from a captured CUDA graph.
    let graph = a.num("graph", 0)? != 0;
    let prefill_repeats = a.num("prefill-repeats", 0)?;
    let max_batch = *batches.iter().max().unwrap_or(&1);
    let min_batch = *batches.iter().min().unwrap_or(&1);
    if tokens < max_batch {
        return Err("--tokens must be >= every --decode-batch".into());
    }
    // Every case prefills `tokens` tokens as `batch` sequences of tokens / batch each.
    let opts = EngineOptions {
        device: dev,
        max_num_seqs: max_batch,
        max_num_tokens: tokens,
        max_seq_len: tokens / min_batch + 2 * steps + 1,
        ..Default::default()
    };
    // Load progress and the load / finalize summaries go to stderr.
    dsv4::log::set_sink(None, dsv4::log::Level::Info);
    let t_create = Instant::now();
    let (mut e, backend) = match a.get("config").or(a.get("model")) {
        Some(d) => create(ConfigSource::Path(d.into()), opts, false)?,
        None => create(ConfigSource::TinyDefault, opts, false)?,
    };
    match a.get("model") {
        Some(d) => e
            .load(Some(std::path::Path::new(d)), LoadFormat::Auto)
            .map_err(err)?,
        None => e.load(None, LoadFormat::Dummy).map_err(err)?,
    }
    e.finalize().map_err(err)?;
    let setup_s = t_create.elapsed().as_secs_f64();
    let setup_peak_rss = bench_load::proc_status_bytes("VmHWM");
    let vocab = e.config().vocab_size;
    let ctx = Context::retain(dev).map_err(err)?;
    let _g = ctx.enter().map_err(err)?;
    let stream = OwnedStream::new(&ctx).map_err(err)?;
    let st = stream.borrow();
    let mb = 1usize << 20;
    let buf = Arena::new(&ctx, 8 * mb + max_batch * vocab * 4).map_err(err)?;
    let w = buf.whole();
    let part = |i: usize| w.slice(i * mb, mb).unwrap();
    let logits = w.slice(8 * mb, max_batch * vocab * 4).map_err(err)?;
    for batch in batches {
        let per = tokens / batch;
        let slots: Vec<i32> = (0..batch as i32).collect();
        // The step's arrays go to fixed device buffers (outside the timed region), so a captured
        // graph can replay later steps with new contents.
        let stage =
            |toks: &[i32], pos: &[i32], qs: &[i32], rows: &[i32]| -> Result<DeviceBatch, String> {
                copy_to_device_sync(part(0), toks, st).map_err(err)?;
                copy_to_device_sync(part(1), pos, st).map_err(err)?;
                copy_to_device_sync(part(2), &slots, st).map_err(err)?;
                copy_to_device_sync(part(3), qs, st).map_err(err)?;
                copy_to_device_sync(part(4), rows, st).map_err(err)?;
                Ok(DeviceBatch {
                    num_tokens: toks.len(),
                    num_seqs: batch,
                    token_ids: part(0).addr(),
                    positions: part(1).addr(),
                    seq_slots: part(2).addr(),
                    query_start: part(3).addr(),
                    logits_rows: part(4).addr(),
                    num_logits: rows.len(),
                    logits: logits.addr(),
                    logits_bf16: false,
                })
            };
        let timed = |f: &mut dyn FnMut() -> Result<(), String>| -> Result<f64, String> {
            let t0 = Instant::now();
            f()?;
            st.synchronize().map_err(err)?;
            Ok(t0.elapsed().as_secs_f64())
        };
        // Position 0 restarts every slot, so each case starts from fresh sequences.
        let (mut toks, mut pos, mut qs, mut rows) = (vec![], vec![], vec![0i32], vec![]);
        for sq in 0..batch {
            toks.extend((0..per).map(|i| ((i * 131 + sq * 17) % vocab) as i32));
            pos.extend(0..per as i32);
            qs.push(toks.len() as i32);
            rows.push(toks.len() as i32 - 1);
        }
        let db = stage(&toks, &pos, &qs, &rows)?;
        // The first prefill of an engine also pays one-time costs (cuBLASLt loads its kernels at
        // their first call): `prefill_ms`. The same prefill again (its sequences restart at
        // position 0) `--prefill-repeats` times: `prefill_ms_repeats`, and their median.
        let prefill_s = timed(&mut || e.forward_device(&db, st.raw() as *mut _).map_err(err))?;
        let mut prefill_again = vec![];
        for _ in 0..prefill_repeats {
            prefill_again.push(timed(&mut || {
                e.forward_device(&db, st.raw() as *mut _).map_err(err)
            })?);
        }
        let decode_step = |k: usize| -> (Vec<i32>, Vec<i32>, Vec<i32>, Vec<i32>) {
            (
                (0..batch).map(|sq| ((k * 7 + sq) % vocab) as i32).collect(),
                vec![(per + k) as i32; batch],
                (0..=batch as i32).collect(),
                (0..batch as i32).collect(),
            )
        };
        let mut decode = vec![];
        for k in 0..steps {
            let (t, p, q, r) = decode_step(k);
            let db = stage(&t, &p, &q, &r)?;
            decode.push(timed(&mut || {
                e.forward_device(&db, st.raw() as *mut _).map_err(err)
            })?);
        }
        // The next `steps` decode steps replayed from ONE captured graph (GLOBAL capture mode):
        // same work without the per-launch host cost.
        let mut graph_ms = vec![];
        if graph {
            let (t, p, q, r) = decode_step(steps);
            let db = stage(&t, &p, &q, &r)?;
            let g =
                dsv4::cuda::graph::Graph::capture(st, || e.forward_device(&db, st.raw() as *mut _))
                    .map_err(err)?;
            for k in steps..2 * steps {
                let (t, p, q, r) = decode_step(k);
                stage(&t, &p, &q, &r)?;
                graph_ms.push(timed(&mut || g.launch(st).map_err(err))?);
            }
        }
        let median = |v: &[f64]| -> f64 {
            let mut s = v.to_vec();
            s.sort_by(|x, y| x.partial_cmp(y).unwrap());
            s.get(s.len() / 2).copied().unwrap_or(f64::NAN) * 1e3
        };
        let ms = |v: &[f64]| {
            v.iter()
                .map(|x| (x * 1e6).round() / 1e3)
                .collect::<Vec<_>>()
        };
        let c = e.config();
        let repeats_json = if prefill_repeats > 0 {
            format!(
                ", \"prefill_ms_repeats_median\": {:.3}, \"prefill_ms_repeats\": {:?}",
                median(&prefill_again),
                ms(&prefill_again)
            )
        } else {
            String::new()
        };
        let graph_json = if graph {
            format!(
                ", \"graph_decode_ms_median\": {:.3}, \"graph_decode_ms_per_step\": {:?}",
                median(&graph_ms),
                ms(&graph_ms)
            )
        } else {
            String::new()
        };
        println!(
            "{{\"backend\": \"{backend}\", \"layers\": {}, \"hidden\": {}, \"experts\": {}, \"setup_s\": {setup_s:.1}, \"setup_peak_rss\": {setup_peak_rss}, \"prefill_tokens\": {}, \"prefill_seqs\": {batch}, \"prefill_ms\": {:.3}{repeats_json}, \"decode_batch\": {batch}, \"decode_steps\": {steps}, \"decode_ms_median\": {:.3}, \"decode_ms_per_step\": {:?}{graph_json}}}",
            c.num_layers,
            c.hidden_size,
            c.n_routed_experts,
            toks.len(),
            prefill_s * 1e3,
            median(&decode),
            ms(&decode)
        );
    }
    Ok(())
}

/// A comma-separated list of positive numbers given to `--flag`.
fn positive_list(v: &str, flag: &str) -> Result<Vec<usize>, String> {
    v.split(',')
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .ok()
                .filter(|&b| b > 0)
                .ok_or_else(|| format!("--{flag} takes positive numbers, got `{x}`"))
        })
        .collect()
}

/// The CUDA device a CUDA-only command runs on: `--device cuda[:N]`, device 0 when not given.
fn cuda_device(a: &Args, what: &str) -> Result<i32, String> {
    let dev = match a.get("device") {
        None => 0,
        Some(_) => device(a)?,
    };
    if dev < 0 {
        return Err(format!("{what} runs on CUDA (--device cuda[:N])"));
    }
    Ok(dev)
}

fn bench(a: &Args) -> Result<(), String> {
    if matches!(a.sub.as_deref(), Some("moe" | "dense" | "attn")) {
        bench_util::set_kernel_defines(a.get("defines"))?;
    } else if a.get("defines").is_some() {
        return Err(format!(
            "--defines is for bench moe, dense and attn\n{USAGE}"
        ));
    }
    match a.sub.as_deref() {
        None => {}
        Some("moe") => {
            let dev = cuda_device(a, "bench moe")?;
            let batches = positive_list(
                a.get("batches")
                    .unwrap_or("1,8,32,64,128,256,512,1024,4096,16384"),
                "batches",
            )?;
            return bench_moe::run(&bench_moe::MoeBench {
                device: dev,
                batches,
                routings: bench_moe::parse_routings(a.get("routing").unwrap_or("uniform,skewed"))?,
                paths: bench_moe::parse_paths(a.get("path").unwrap_or("auto"))?,
                router: bench_moe::parse_router(a.get("router").unwrap_or("auto"))?,
                ids_dir: a.get("ids-dir").map(PathBuf::from),
                trace_dir: a.get("trace").map(PathBuf::from),
            });
        }
        Some("dense") => {
            let dev = cuda_device(a, "bench dense")?;
            let tokens = positive_list(
                a.get("tokens")
                    .unwrap_or("1,2,4,8,16,32,64,128,512,2048,8192"),
                "tokens",
            )?;
            let probe = match a.get("read-probe") {
                Some(v) => positive_list(v, "read-probe")?,
                None => vec![],
            };
            let candidates = a.num("lt-candidates", 0)?;
            return bench_dense::run(dev, &tokens, a.get("projection"), &probe, candidates);
        }
        Some("attn") => {
            let dev = cuda_device(a, "bench attn")?;
            let contexts =
                positive_list(a.get("contexts").unwrap_or("4096,65536,262144"), "contexts")?;
            let batches = positive_list(a.get("batches").unwrap_or("1,8,64"), "batches")?;
            let chunks = match a.get("indexer-chunks") {
                Some(v) => positive_list(v, "indexer-chunks")?,
                None => vec![],
            };
            return bench_attn::run(dev, &contexts, &batches, &chunks);
        }
        Some("load") => return bench_load::run(a, device(a)?),
        Some("refit") => return bench_refit::run(a, device(a)?),
        Some(other) => return Err(format!("unknown bench `{other}`\n{USAGE}")),
    }
    let dev = device(a)?;
    if dev >= 0 {
        return bench_cuda(a, dev);
    }
    let tokens = a.num("tokens", 256)?;
    let steps = a.num("decode-steps", 16)?.max(1);
    let batch = a.num("decode-batch", 4)?.max(1);
    let opts = EngineOptions {
        device: device(a)?,
        max_num_seqs: batch,
        max_num_tokens: tokens.max(batch),
        max_seq_len: tokens + steps + 1,
        ..Default::default()
    };
    let (mut e, backend) = match a.get("model") {
        Some(d) => {
            let (mut e, b) = create(ConfigSource::Path(d.into()), opts, false)?;
            e.load(Some(std::path::Path::new(d)), LoadFormat::Auto)
                .map_err(err)?;
            (e, b)
        }
        None => {
            let (mut e, b) = create(ConfigSource::TinyDefault, opts, false)?;
            e.load(None, LoadFormat::Dummy).map_err(err)?;
            (e, b)
        }
    };
    e.finalize().map_err(err)?;
    let vocab = e.config().vocab_size;
    let prompts: Vec<Vec<i32>> = (0..batch)
        .map(|s| {
            (0..tokens / batch)
                .map(|i| ((i * 13 + s * 7) % vocab) as i32)
                .collect()
        })
        .collect();
    let (_, prefill_s, decode_s, prefill_tokens) = generate(&mut e, &prompts, steps + 1)?;
    println!(
        "{{\"backend\": \"{backend}\", \"prefill_tokens\": {prefill_tokens}, \"prefill_ms\": {:.3}, \"decode_batch\": {batch}, \"decode_steps\": {steps}, \"decode_ms_per_step\": {:.3}}}",
        prefill_s * 1e3,
        decode_s * 1e3 / steps as f64
    );
    Ok(())
}
