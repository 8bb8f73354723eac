//! Manual exploration (ignored).
#[test]
#[ignore]
fn explore() {
    let n: u64 = std::env::var("SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let start: u64 = std::env::var("START")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let steps: u32 = std::env::var("STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    for seed in start..start + n {
        let t = std::time::Instant::now();
        let opts = chanwatch_sim::SimOptions {
            steps,
            keep_trace: std::env::var("FULL").is_ok(),
            echo_trace: std::env::var("ECHO").is_ok(),
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
        if !r.passed() || std::env::var("FULL").is_ok() {
            for l in &r.trace[r
                .trace
                .len()
                .saturating_sub(if std::env::var("FULL").is_ok() {
                    100000
                } else {
                    25
                })..]
            {
                println!("      {l}");
            }
        }
    }
}
