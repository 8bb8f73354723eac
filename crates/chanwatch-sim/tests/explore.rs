//! Manual exploration (ignored): `SEEDS=n START=s STEPS=k FULL=1 ECHO=1 PLANT=fence|ack`.
#[test]
#[ignore]
fn explore() {
    let env = |k: &str| std::env::var(k).ok();
    let n: u64 = env("SEEDS").and_then(|s| s.parse().ok()).unwrap_or(5);
    let start: u64 = env("START").and_then(|s| s.parse().ok()).unwrap_or(0);
    let steps: u32 = env("STEPS").and_then(|s| s.parse().ok()).unwrap_or(300);
    let planted_bug = match env("PLANT").as_deref() {
        Some("fence") => Some(chanwatch_sim::PlantedBug::NoFencing),
        Some("ack") => Some(chanwatch_sim::PlantedBug::UnguardedAck),
        _ => None,
    };
    let full = env("FULL").is_some();
    for seed in start..start + n {
        let t = std::time::Instant::now();
        let opts = chanwatch_sim::SimOptions {
            steps,
            keep_trace: full,
            echo_trace: env("ECHO").is_some(),
            planted_bug,
            ..Default::default()
        };
        let r = chanwatch_sim::run_seed(seed, &opts).unwrap();
        println!(
            "seed {seed}: {:?} wall {:?} sim {} ms revs {} lines {} settle {:?} faults {:?}",
            r.violations.len(),
            t.elapsed(),
            r.sim_ms,
            r.revisions,
            r.trace_lines,
            r.settle_ms,
            r.faults
        );
        for v in r.violations.iter().take(5) {
            println!("   {v}");
        }
        if !r.passed() || full {
            let keep = if full { usize::MAX } else { 25 };
            for l in &r.trace[r.trace.len().saturating_sub(keep)..] {
                println!("      {l}");
            }
        }
    }
}
