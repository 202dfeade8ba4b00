//! `dsv4 bench attn`: the fast set's sparse attention (kernels/fast_attention.cu, issue 12) alone
//! at Flash shapes (64 heads of 512, window 128), decode: B sequences of one token each at the
//! end of a context of C positions, over random official-format state (paged FP8 nope + BF16
//! RoPE rows). CSA layers attend to the window + 512 selected entries (random distinct-ish
//! indices among the C/4 visible), HCA layers to the window + all C/128 entries. One JSON line
//! per (layer kind, context, batch, kernel): time per call, keys per token, the KV bytes gathered
//! and the bytes a call must move (KV rows + BF16 q and o), GB/s on them. The attention kernels:
//! `fast` (the fast set's pick), `fast_mma`, `fast_wgmma`, `fast_wgmma_ws` (the warp-specialized
//! wgmma kernel), `fast_wgmma_ws_early` (the same retiring each P V at the next softmax's
//! exchange) and, from 32 tokens where the split rule splits, `fast_wgmma_ws_unsplit`; where the
//! rule's splits combine in a thread-block cluster, `fast_mma_workspace` and `fast_wgmma_workspace`
//! (the same kernels combining through the workspace and fa_combine_kernel); `fast_splits`: the
//! fast set's pick at 2, 4 and 8 splits (the rule's alternatives). Each line says its `splits` and
//! whether they combined in a cluster (`cluster_combine`). CSA
//! cases also time the indexer (kernels/fast_indexer.cu: scoring all C/4 visible keys, then the
//! top-512; `kernel: indexer_fast`, the fast set's call: the scale fold with the tensor-core head sum;
//! `indexer_plain`: `fi_score_kernel`, the per-32-block promotion and the ordered head sum;
//! `indexer_fast_tc`: the same with its head sum on the tensor core, `fi_score_tc_kernel`;
//! `indexer_fast_fold` and `indexer_fast_fold_tc`: the scale fold with
//! one chain of 128 dims (`fi_score_fold_kernel`, `fi_score_fold_tc_kernel`), the latter also at
//! chunks of 64, 128 and 256 keys and 1, 2, 4 and 8 chunks a block (lines with `chunk_keys`);
//! `indexer_fast_fold64_tc`: two chains of 64; `indexer_stream`: the streamed scoring,
//! `fi_score_stream_kernel`, also at 2 to 64 tiles a block; `indexer_score`: its scoring launch
//! alone; `indexer_topk_only`: its top-k launch (`fi_topk_kernel`) alone, on the scores the last
//! scoring left, and `indexer_topk`: both, at clusters of 1, 2, 4 and 8 blocks a token;
//! `indexer_fused`: the streamed scoring
//! with the top-k in its launch, `fi_select_stream_kernel`, at clusters of 2, 4, 8 and 16 blocks a
//! token where the runs fit). The reference kernels (attention_kernel,
//! indexer_kernel, f64) run the same cases up to 8 tokens as the in-run baseline;
//! bench/attn_baseline.py adds the HBM
//! ceiling, floors, ratios and PyTorch.
//!
//! Timing: the state is replicated into enough copies (as if layers: together at least 256 MB,
//! so the 50 MB L2 holds none of it between calls; q, the selection and o are shared, as the
//! layer's own producer leaves them in L2), one call per copy is captured into a CUDA graph,
//! replayed 21 times between CUDA events (bench_util::time_graph); the median replay / copies
//! is reported (`time_us`), the host clock's beside it (`host_time_us`).

use std::io::Write;

use crate::bench_util::{Rng, alloc, e, kernel_cache, time_graph};
use dsv4::cuda::arena::{self, DevicePtr};
use dsv4::cuda::context::Context;
use dsv4::cuda::kernels::attention::{self, Attention, AttentionArgs, BatchMeta};
use dsv4::cuda::kernels::fast_attention::{
    self, AttentionPath, CLUSTER_MAX_SPLITS, FastAttention, FastAttentionWorkspace, SplitCombine,
};
use dsv4::cuda::kernels::fast_indexer::{
    self, FastIndexer, HeadSum, ScaleFold, SelectPart, SelectPlan,
};
use dsv4::cuda::kernels::indexer::{self, Indexer, IndexerArgs};
use dsv4::cuda::kv_pages::{KV_PAGE, KvFormat, KvPagesDev, KvRows};
use dsv4::cuda::registry::Registry;
use dsv4::cuda::stream::OwnedStream;

const H: usize = 64;
const HD: usize = 512;
const NOPE: usize = 448;
const W: usize = 128;
const TOPK: usize = 512;
/// Indexer head dim (64 heads of it, like the attention's).
const DI: usize = 128;
/// Largest batch the reference kernel is timed at (it takes seconds beyond).
const REFERENCE_MAX_T: usize = 8;
/// Smallest batch the warp-specialized kernel is also timed unsplit at (below, one block a token
/// leaves most SMs idle).
const UNSPLIT_MIN_T: usize = 32;

/// The layer kinds: (name, compression ratio, CSA).
const KINDS: [(&str, usize, bool); 2] = [("csa", 4, true), ("hca", 128, false)];

/// `pages` random official pages: e4m3 codes (no NaN), UE8M0 scales 2^-10 .. 2^-6, BF16 RoPE.
fn template_pages(rng: &mut Rng, rows: &KvRows, pages: usize) -> Vec<u8> {
    let mut v = vec![0u8; pages * rows.page_bytes()];
    for page in v.chunks_exact_mut(rows.page_bytes()) {
        for r in 0..KV_PAGE {
            let row = &mut page[r * rows.row_bytes()..][..rows.row_bytes()];
            for b in &mut row[..NOPE] {
                let c = (rng.next() & 0xff) as u8;
                *b = if c & 0x7f == 0x7f { c & 0xf7 } else { c };
            }
            for c in 0..HD - NOPE {
                let bits = half::bf16::from_f32(rng.bf16()).to_bits().to_le_bytes();
                row[NOPE + 2 * c..NOPE + 2 * c + 2].copy_from_slice(&bits);
            }
            let sc = KV_PAGE * rows.row_bytes() + r * rows.scale_bytes();
            for b in &mut page[sc..sc + NOPE / 64] {
                *b = 117 + (rng.next() % 5) as u8;
            }
        }
    }
    v
}

/// Fills `dst` with whole copies of the template already on the device at `tpl`.
fn fill(dst: DevicePtr, tpl: DevicePtr, s: dsv4::cuda::BorrowedStream) -> Result<(), String> {
    let mut off = 0;
    while off < dst.bytes() {
        let n = tpl.bytes().min(dst.bytes() - off);
        arena::memcpy_dtod_async(
            dst.slice(off, n).map_err(e)?,
            tpl.slice(0, n).map_err(e)?,
            s,
        )
        .map_err(e)?;
        off += n;
    }
    Ok(())
}

/// `chunks`: scoring chunk sizes to time the fast indexer at besides its own choice (lines with
/// `chunk_keys`; `dsv4 bench attn --indexer-chunks 64,128,256`).
pub fn run(
    device: i32,
    contexts: &[usize],
    batches: &[usize],
    chunks: &[usize],
) -> Result<(), String> {
    let ctx = Context::retain(device).map_err(e)?;
    let _g = ctx.enter().map_err(e)?;
    let stream = OwnedStream::new(&ctx).map_err(e)?;
    let s = stream.borrow();
    let reg = Registry::load_families(
        &ctx,
        &[
            &attention::SOURCE,
            &fast_attention::SOURCE,
            &indexer::SOURCE,
            &fast_indexer::SOURCE,
        ],
        &kernel_cache()?,
    )
    .map_err(e)?;
    let reference = Attention::new(&reg).map_err(e)?;
    let fast = FastAttention::new(&reg).map_err(e)?;
    let indexers = Indexers {
        reference: Indexer::new(&reg).map_err(e)?,
        fast: FastIndexer::new(&reg).map_err(e)?,
        keys: KvRows::index_keys(KvFormat::Official, DI),
        chunks: chunks.to_vec(),
    };
    let rows = KvRows::kv(KvFormat::Official, HD, NOPE);
    let mut rng = Rng(0xA77E_5EED);
    let tpl_pages = 256;
    let tpl = template_pages(&mut rng, &rows, tpl_pages);
    let tmax = batches.iter().copied().max().unwrap_or(1);
    let [po, pml] = fast_attention::workspace_floats(H, HD);
    // Shared buffers: the template, batch metadata, q, kv rows, selection, sinks, o, workspace.
    let (_shared, sp) = alloc(
        &ctx,
        "bench_attn",
        &[
            tpl.len(),
            tmax * 4,
            (tmax + 1) * 4,
            tmax * 4,
            tmax * 4,
            tmax * H * HD * 4,
            tmax * HD * 4,
            tmax * TOPK * 4,
            tmax * 4,
            H * 4,
            tmax * H * HD * 4,
            po * 4,
            pml * 4,
            tmax * fast_attention::staged_row_bytes(HD, NOPE),
            tmax * fast_attention::q_bf16_bytes(H, HD),
        ],
    )?;
    arena::copy_to_device_sync(sp[0], &tpl, s).map_err(e)?;
    let q: Vec<f32> = (0..tmax * H * HD).map(|_| rng.bf16()).collect();
    arena::copy_to_device_sync(sp[5], &q, s).map_err(e)?;
    // The BF16 copy the forward's head_prep writes for the fast kernels (the same values).
    let q16: Vec<u16> = q
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    arena::copy_to_device_sync(sp[14], &q16, s).map_err(e)?;
    // (The batch's own KV row: BF16 values; their nope part is not FP8-simulated here, which
    // changes nothing the kernel does.)
    let kv: Vec<f32> = (0..tmax * HD).map(|_| rng.bf16()).collect();
    arena::copy_to_device_sync(sp[6], &kv, s).map_err(e)?;
    let sinks: Vec<f32> = (0..H).map(|_| rng.bf16()).collect();
    arena::copy_to_device_sync(sp[9], &sinks, s).map_err(e)?;
    let ws = FastAttentionWorkspace {
        part_o: sp[11],
        part_ml: sp[12],
        staged: sp[13],
        q_bf16: sp[14],
    };
    for &(kind, ratio, csa) in &KINDS {
        for &ctx_len in contexts {
            for &t in batches {
                // t sequences in t slots, one decode token each at position ctx_len - 1.
                let maxe = ctx_len / ratio;
                let pps = KvRows::pages_for(maxe);
                let ring_pages = KvRows::pages_for(W);
                let state_bytes = t * (pps + ring_pages) * rows.page_bytes();
                let copies = (256usize << 20).div_ceil(state_bytes).clamp(1, 256);
                let mut sizes = vec![];
                for _ in 0..copies {
                    sizes.extend([
                        t * ring_pages * rows.page_bytes(),
                        t * pps * rows.page_bytes(),
                    ]);
                }
                sizes.push(t * pps * 4);
                let (_state, st) = alloc(&ctx, "bench_attn_state", &sizes)?;
                for p in &st[..2 * copies] {
                    fill(*p, sp[0], s)?;
                }
                let table = st[2 * copies];
                let order: Vec<i32> = (0..(t * pps) as i32).collect();
                arena::copy_to_device_sync(table, &order, s).map_err(e)?;
                let p = (ctx_len - 1) as i32;
                let positions = vec![p; t];
                let query_start: Vec<i32> = (0..=t as i32).collect();
                let slots: Vec<i32> = (0..t as i32).collect();
                for (d, v) in [
                    (sp[1], &positions),
                    (sp[2], &query_start),
                    (sp[3], &slots),
                    (sp[4], &slots),
                ] {
                    arena::copy_to_device_sync(d, v, s).map_err(e)?;
                }
                let visible = (ctx_len / ratio).min(maxe);
                let nsel = visible.min(TOPK);
                let mut selected = vec![-1i32; t * TOPK];
                for i in 0..t {
                    for k in 0..nsel {
                        selected[i * TOPK + k] = (rng.next() % visible as u64) as i32;
                    }
                }
                arena::copy_to_device_sync(sp[7], &selected, s).map_err(e)?;
                arena::copy_to_device_sync(sp[8], &vec![nsel as i32; t], s).map_err(e)?;
                let meta = BatchMeta {
                    positions: sp[1],
                    query_start: sp[2],
                    seq_slots: sp[3],
                    seq_of: sp[4],
                    num_tokens: t,
                    num_seqs: t,
                };
                let args = |j: usize| AttentionArgs {
                    q: sp[5],
                    q_bf16: Some(sp[14]),
                    kv: sp[6],
                    ring: KvPagesDev {
                        pool: st[2 * j],
                        table: None,
                        pages_per_slot: ring_pages,
                        rows,
                    },
                    entries: Some(KvPagesDev {
                        pool: st[2 * j + 1],
                        table: Some(table),
                        pages_per_slot: pps,
                        rows,
                    }),
                    selected: csa.then_some((sp[7], sp[8])),
                    sinks: sp[9],
                    heads: H,
                    head_dim: HD,
                    window: W,
                    ratio,
                    maxe,
                    topk: TOPK,
                    num_slots: t,
                    official: true,
                    o: sp[10],
                };
                let keys = W.min(ctx_len) + if csa { nsel } else { visible };
                let kv_bytes = t * keys * rows.bytes_per_row();
                let io_bytes = kv_bytes + t * 2 * H * HD * 2;
                // "fast" is the path the fast set picks (AttentionPath::Auto); every kernel is
                // timed besides it for the crossover, and the warp-specialized one unsplit too
                // where the rule splits many tokens' keys (`_unsplit`: which side of the split
                // rule it wants).
                let rule_splits = fast_attention::splits(t, W + if csa { TOPK } else { maxe });
                // (name, kernel, splits: None = the rule's, combine); None kernel = the reference.
                let cl = SplitCombine::Cluster;
                let mut kernels: Vec<(String, Option<AttentionPath>, Option<usize>, SplitCombine)> = vec![
                    ("fast".into(), Some(AttentionPath::Auto), None, cl),
                    ("fast_mma".into(), Some(AttentionPath::Mma), None, cl),
                    ("fast_wgmma".into(), Some(AttentionPath::Wgmma), None, cl),
                    (
                        "fast_wgmma_ws".into(),
                        Some(AttentionPath::WgmmaWs),
                        None,
                        cl,
                    ),
                    (
                        "fast_wgmma_ws_early".into(),
                        Some(AttentionPath::WgmmaWsEarlyPv),
                        None,
                        cl,
                    ),
                ];
                // Where the rule's splits combine in a cluster: the workspace's combine beside it.
                if (2..=CLUSTER_MAX_SPLITS).contains(&rule_splits) {
                    for (name, path) in [
                        ("fast_mma", AttentionPath::Mma),
                        ("fast_wgmma", AttentionPath::Wgmma),
                    ] {
                        kernels.push((
                            format!("{name}_workspace"),
                            Some(path),
                            None,
                            SplitCombine::Workspace,
                        ));
                    }
                }
                // The fast set's pick at other split counts (`fast_splits`: the split rule's
                // alternatives; each combined as SplitCombine::Cluster says, `cluster_combine`).
                for n in [2, 4, 8] {
                    if n != rule_splits && t * n <= fast_attention::SPLIT_TARGET {
                        kernels.push((
                            "fast_splits".into(),
                            Some(AttentionPath::Auto),
                            Some(n),
                            cl,
                        ));
                    }
                }
                if t >= UNSPLIT_MIN_T && rule_splits > 1 {
                    kernels.push((
                        "fast_wgmma_ws_unsplit".into(),
                        Some(AttentionPath::WgmmaWs),
                        Some(1),
                        cl,
                    ));
                }
                if t <= REFERENCE_MAX_T {
                    kernels.push(("reference".into(), None, Some(1), cl));
                }
                for (kernel, path, splits, combine) in &kernels {
                    let call = |j: usize| -> dsv4::Result<()> {
                        match path {
                            Some(p) => fast.attention_split(
                                *p,
                                *splits,
                                *combine,
                                &ctx,
                                &meta,
                                &args(j),
                                &ws,
                                s,
                            ),
                            None => reference.attention(&ctx, &meta, &args(j), s),
                        }
                    };
                    // The reference takes long: a few copies suffice to time it.
                    let n = if path.is_some() {
                        copies
                    } else {
                        copies.min(4)
                    };
                    let replays = 21;
                    let timing = time_graph(s, n, replays, call)?;
                    let sec = timing.device_s;
                    println!(
                        "{{\"bench\": \"attn\", \"layer\": \"{kind}\", \"kernel\": \"{kernel}\", \"context\": {ctx_len}, \"T\": {t}, \"heads\": {H}, \"head_dim\": {HD}, \"keys_per_token\": {keys}, \"splits\": {}, \"cluster_combine\": {}, \"time_us\": {:.2}, \"host_time_us\": {:.2}, \"kv_bytes\": {kv_bytes}, \"io_bytes\": {io_bytes}, \"gb_per_s\": {:.1}, \"state_copies\": {n}, \"calls_timed\": {}}}",
                        splits.unwrap_or(rule_splits),
                        path.is_some_and(|p| {
                            let p = match p {
                                AttentionPath::Auto => AttentionPath::for_layer(&args(0), t),
                                p => p,
                            };
                            combine.in_cluster(p, splits.unwrap_or(rule_splits))
                        }),
                        sec * 1e6,
                        timing.host_s * 1e6,
                        io_bytes as f64 / sec / 1e9,
                        replays * n,
                    );
                    std::io::stdout().flush().ok();
                }
                if csa {
                    indexer_case(&ctx, s, &indexers, &meta, &mut rng, ctx_len, t)?;
                }
            }
        }
    }
    Ok(())
}

/// The indexer's kernels and its key rows.
struct Indexers {
    reference: Indexer,
    fast: FastIndexer,
    keys: KvRows,
    /// Scoring chunk sizes timed besides the fast indexer's own choice (`--indexer-chunks`).
    chunks: Vec<usize>,
}

/// Times the fast indexer (and the reference one up to [`REFERENCE_MAX_T`] tokens) of a CSA
/// layer for the decode batch `meta` (t tokens at position ctx_len - 1 in slots 0 .. t):
/// scoring all ctx_len / 4 visible keys with 64 heads of 128, then the top-512. One JSON line
/// each; the bytes a call must move: the keys (68 B each), q as BF16, the head weights and the
/// selection.
fn indexer_case(
    ctx: &Context,
    s: dsv4::cuda::BorrowedStream,
    ix: &Indexers,
    meta: &BatchMeta,
    rng: &mut Rng,
    ctx_len: usize,
    t: usize,
) -> Result<(), String> {
    let maxe = ctx_len / 4;
    let pps = KvRows::pages_for(maxe);
    let pool_bytes = t * pps * ix.keys.page_bytes();
    let copies = (256usize << 20).div_ceil(pool_bytes).clamp(1, 256);
    let mut tpl = vec![0u8; 64 * ix.keys.page_bytes()];
    for page in tpl.chunks_exact_mut(ix.keys.page_bytes()) {
        for r in 0..KV_PAGE {
            for b in &mut page[r * ix.keys.row_bytes()..][..DI / 2] {
                *b = (rng.next() & 0xff) as u8;
            }
            let sc = KV_PAGE * ix.keys.row_bytes() + r * ix.keys.scale_bytes();
            for b in &mut page[sc..sc + DI / 32] {
                *b = 120 + (rng.next() % 7) as u8;
            }
        }
    }
    let mut sizes = vec![pool_bytes; copies];
    sizes.extend([
        tpl.len(),
        t * pps * 4,
        t * H * DI * 4,
        t * H * 4,
        t * maxe * 4,
        t * TOPK * 4,
        t * 4,
    ]);
    let (_bufs, b) = alloc(ctx, "bench_attn_indexer", &sizes)?;
    let x = &b[copies..];
    arena::copy_to_device_sync(x[0], &tpl, s).map_err(e)?;
    for p in &b[..copies] {
        fill(*p, x[0], s)?;
    }
    let order: Vec<i32> = (0..(t * pps) as i32).collect();
    arena::copy_to_device_sync(x[1], &order, s).map_err(e)?;
    // Official queries: FP4 values (a BF16 value's top nibble is close enough for timing).
    let qi: Vec<f32> = (0..t * H * DI).map(|_| rng.bf16()).collect();
    arena::copy_to_device_sync(x[2], &qi, s).map_err(e)?;
    let iw: Vec<f32> = (0..t * H).map(|_| rng.bf16() / 90.5).collect();
    arena::copy_to_device_sync(x[3], &iw, s).map_err(e)?;
    let args = |j: usize| IndexerArgs {
        qi: x[2],
        iw: x[3],
        ikeys: KvPagesDev {
            pool: b[j],
            table: Some(x[1]),
            pages_per_slot: pps,
            rows: ix.keys,
        },
        heads: H,
        dim: DI,
        ratio: 4,
        topk: TOPK,
        maxe,
        num_slots: t,
        official: true,
        scores: x[4],
        selected: x[5],
        nsel: x[6],
    };
    let kv_bytes = t * maxe * ix.keys.bytes_per_row();
    let io_bytes = kv_bytes + t * (H * DI * 2 + H * 4 + TOPK * 4);
    // (The reference indexer ranks every visible key against the others: beyond 64K positions
    // it takes seconds a call.)
    let fast_kernels = [
        "indexer_fast",
        "indexer_plain",
        "indexer_fast_tc",
        "indexer_fast_fold",
        "indexer_fast_fold_tc",
        "indexer_fast_fold64_tc",
        "indexer_stream",
    ];
    let kernels: Vec<&str> = if t <= REFERENCE_MAX_T && ctx_len <= 65536 {
        fast_kernels
            .iter()
            .copied()
            .chain(["indexer_reference"])
            .collect()
    } else {
        fast_kernels.to_vec()
    };
    // The fast set's work split with a kernel's head sum and scale fold.
    let plan_for = |head_sum, fold| {
        let chunk_keys = fast_indexer::chunk_keys_for(t, maxe);
        SelectPlan {
            chunk_keys,
            stage_keys: fast_indexer::stage_keys_for(maxe, fast_indexer::topk_cluster_for(t, maxe)),
            head_sum,
            fold,
            chunks_per_block: if fold == ScaleFold::Off {
                1
            } else {
                fast_indexer::chunks_per_block_for(t, maxe, chunk_keys)
            },
            streamed: false,
            fused_topk: None,
            topk_cluster: fast_indexer::topk_cluster_for(t, maxe),
        }
    };
    // Times `call` over `n` state copies and prints its line: `fields`, then the timing.
    let timed = |fields: String, n: usize, call: &dyn Fn(usize) -> dsv4::Result<()>| {
        let replays = 21;
        let timing = time_graph(s, n, replays, call)?;
        let sec = timing.device_s;
        println!(
            "{{\"bench\": \"attn\", \"layer\": \"csa\", {fields}, \"time_us\": {:.2}, \"host_time_us\": {:.2}, \"kv_bytes\": {kv_bytes}, \"io_bytes\": {io_bytes}, \"gb_per_s\": {:.1}, \"state_copies\": {n}, \"calls_timed\": {}}}",
            sec * 1e6,
            timing.host_s * 1e6,
            io_bytes as f64 / sec / 1e9,
            replays * n,
        );
        std::io::stdout().flush().ok();
        Ok::<(), String>(())
    };
    // A line's fields that name the case: the kernel, then the shapes.
    let case = |kernel: &str| {
        format!(
            "\"kernel\": \"{kernel}\", \"context\": {ctx_len}, \"T\": {t}, \"heads\": {H}, \"head_dim\": {DI}, \"keys_per_token\": {maxe}, \"topk\": {TOPK}"
        )
    };
    for &kernel in &kernels {
        let fields = format!("{}, \"splits\": 1", case(kernel));
        let variant = match kernel {
            "indexer_plain" => Some(plan_for(HeadSum::Ordered, ScaleFold::Off)),
            "indexer_fast_tc" => Some(plan_for(HeadSum::TensorCore, ScaleFold::Off)),
            "indexer_fast_fold" => Some(plan_for(HeadSum::Ordered, ScaleFold::Chain128)),
            "indexer_fast_fold_tc" => Some(plan_for(HeadSum::TensorCore, ScaleFold::Chain128)),
            "indexer_fast_fold64_tc" => Some(plan_for(HeadSum::TensorCore, ScaleFold::Chain64)),
            "indexer_stream" => Some(fast_indexer::stream_plan(t, maxe)),
            _ => None,
        };
        if kernel == "indexer_fast" {
            timed(fields, copies, &|j| ix.fast.select(ctx, meta, &args(j), s))?;
        } else if let Some(plan) = variant {
            let fields = format!("{fields}, \"chunks_per_block\": {}", plan.chunks_per_block);
            timed(fields, copies, &|j| {
                ix.fast.select_with(ctx, meta, &args(j), plan, s)
            })?;
        } else {
            timed(fields, copies.min(2), &|j| {
                ix.reference.select(ctx, meta, &args(j), s)
            })?;
        }
    }
    // The fold kernel with the tensor-core head sum at each chunk size and number of chunks a
    // block (its tiles are cheaper than the plain kernel's, so the plain kernel's chunk rule,
    // which weighed a chunk's query encoding against idle SMs, may not be its best).
    let own = plan_for(HeadSum::TensorCore, ScaleFold::Chain128);
    for chunk_keys in [
        fast_indexer::TILE_KEYS,
        2 * fast_indexer::TILE_KEYS,
        fast_indexer::CHUNK_KEYS,
    ] {
        for chunks_per_block in [1, 2, 4, 8] {
            let plan = SelectPlan {
                chunk_keys,
                chunks_per_block,
                ..own
            };
            let fields = format!(
                "{}, \"chunk_keys\": {chunk_keys}, \"chunks_per_block\": {chunks_per_block}, \"chosen\": {}",
                case("indexer_fast_fold_tc"),
                chunk_keys == own.chunk_keys && chunks_per_block == own.chunks_per_block
            );
            timed(fields, copies, &|j| {
                ix.fast.select_with(ctx, meta, &args(j), plan, s)
            })?;
        }
    }
    // The streamed kernel at each number of 64-key tiles a block (its plan's line says which it
    // takes: "chosen").
    let stream_own = fast_indexer::stream_plan(t, maxe);
    for tiles in [2, 4, 8, 16, 32, 64] {
        let plan = SelectPlan {
            chunks_per_block: tiles,
            ..stream_own
        };
        let fields = format!(
            "{}, \"chunk_keys\": {}, \"chunks_per_block\": {tiles}, \"chosen\": {}",
            case("indexer_stream"),
            plan.chunk_keys,
            tiles == stream_own.chunks_per_block
        );
        timed(fields, copies, &|j| {
            ix.fast.select_with(ctx, meta, &args(j), plan, s)
        })?;
    }
    // The streamed plan's two launches apart: its scoring alone, then (on the scores that left)
    // its separate top-k alone, and the whole select, at each top-k cluster size (the plan's
    // lines say which it takes: "chosen").
    let fields = format!("{}, \"chosen\": true", case("indexer_score"));
    timed(fields, copies, &|j| {
        ix.fast
            .select_part(ctx, meta, &args(j), stream_own, SelectPart::Scoring, s)
    })?;
    for topk_cluster in [1, 2, 4, fast_indexer::TOPK_CLUSTER] {
        let plan = SelectPlan {
            topk_cluster,
            stage_keys: fast_indexer::stage_keys_for(maxe, topk_cluster),
            ..stream_own
        };
        let chosen = topk_cluster == stream_own.topk_cluster;
        for (kernel, part) in [
            ("indexer_topk_only", SelectPart::TopK),
            ("indexer_topk", SelectPart::Both),
        ] {
            let fields = format!(
                "{}, \"topk_cluster\": {topk_cluster}, \"chosen\": {chosen}",
                case(kernel)
            );
            timed(fields, copies, &|j| {
                ix.fast.select_part(ctx, meta, &args(j), plan, part, s)
            })?;
        }
    }
    // The streamed scoring with the top-k in its launch, at each cluster size whose runs fit.
    for cluster in [2, 4, 8, fast_indexer::FUSED_MAX_CLUSTER] {
        let Some(plan) = fast_indexer::fused_plan(t, maxe, cluster) else {
            continue;
        };
        let fields = format!("{}, \"cluster\": {cluster}", case("indexer_fused"));
        timed(fields, copies, &|j| {
            ix.fast.select_with(ctx, meta, &args(j), plan, s)
        })?;
    }
    for &chunk_keys in &ix.chunks {
        let plan = SelectPlan {
            chunk_keys,
            stage_keys: fast_indexer::stage_keys_for(maxe, fast_indexer::topk_cluster_for(t, maxe)),
            head_sum: HeadSum::Ordered,
            fold: ScaleFold::Off,
            chunks_per_block: 1,
            streamed: false,
            fused_topk: None,
            topk_cluster: fast_indexer::topk_cluster_for(t, maxe),
        };
        let chosen = chunk_keys == fast_indexer::chunk_keys_for(t, maxe);
        let fields = format!(
            "{}, \"chunk_keys\": {chunk_keys}, \"chosen\": {chosen}",
            case("indexer_fast")
        );
        timed(fields, copies, &|j| {
            ix.fast.select_with(ctx, meta, &args(j), plan, s)
        })?;
    }
    Ok(())
}
