//! What the kernel benches (`bench moe`, `bench dense`) share: their buffers and errors.

use dsv4::cuda::arena::{Arena, ArenaPlan, DevicePtr};
use dsv4::cuda::context::Context;

/// A library error as the CLI prints it.
pub fn e(x: dsv4::Error) -> String {
    x.to_string()
}

/// One arena with a region of each byte size (at least 4), named `<tag>.<i>`.
pub fn alloc(ctx: &Context, tag: &str, bytes: &[usize]) -> Result<(Arena, Vec<DevicePtr>), String> {
    let mut plan = ArenaPlan::new();
    let ids: Vec<_> = bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| plan.reserve(format!("{tag}.{i}"), b.max(4), 256))
        .collect::<Result<_, _>>()
        .map_err(e)?;
    let a = Arena::from_plan(ctx, &plan).map_err(e)?;
    let p = ids.iter().map(|&i| a.region(i)).collect();
    Ok((a, p))
}
