//! `make bench-index-peers`: `kvpool::KVIndex` beside the indexes the routers ship, on one
//! recorded stream (see `workload.rs`), at 100, 1,000 and 7,000 instances.
//!
//! For each instance count: the stream is generated once; every index first replays it with a
//! correctness pass (every `--sample`-th lookup's per-instance depths compared with a plain
//! reference, `reference.rs`; a disagreement stops the run); then `--rounds` interleaved rounds
//! (each round runs every index in turn, the order rotating) of: an apply-only replay (events
//! and blocks per second), a replay with each lookup timed between the batches (compact answer
//! where the index has one), and, for kvpool, the same with one row per matching location.
//! Reported: the median over the rounds. Memory: one child process per index replays the whole
//! stream (read from a file, so that generating it leaves nothing behind) and reports its RSS
//! growth, divided by the live (instance, block) entries at the end.
//!
//! Usage: `index_peers [--instances 100,1000,7000] [--rounds 5] [--indexes a,b] [--sample 10]
//! [--no-memory]`; `index_peers memory <index> <stream file>` is the child, `index_peers save
//! <instances> <stream file>` writes a stream for it; `index_peers writers [--instances ..]
//! [--threads 1,2] [--rounds 5] [--no-peers]` measures apply with several writer threads
//! (`writers.rs`).

mod peers;
mod reference;
mod workload;
mod writers;

use std::time::Instant;

use peers::{Answer, Index};
use workload::{Step, Workload};

struct Args {
    instances: Vec<usize>,
    rounds: usize,
    indexes: Vec<String>,
    sample: usize,
    memory: bool,
    threads: Vec<usize>,
    peers: bool,
}

fn parse_args(args: &[String]) -> Result<Args, String> {
    let mut a = Args {
        instances: vec![100, 1_000, 7_000],
        rounds: 5,
        indexes: peers::NAMES.iter().map(|s| s.to_string()).collect(),
        sample: 10,
        memory: true,
        threads: vec![1, 2],
        peers: true,
    };
    let mut i = 0;
    while i < args.len() {
        let value = |i: usize| {
            args.get(i + 1)
                .cloned()
                .ok_or_else(|| format!("{} needs a value", args[i]))
        };
        match args[i].as_str() {
            "--instances" => {
                a.instances = value(i)?
                    .split(',')
                    .map(|x| x.trim().parse().map_err(|e| format!("--instances: {e}")))
                    .collect::<Result<_, _>>()?;
                i += 1;
            }
            "--rounds" => {
                a.rounds = value(i)?.parse().map_err(|e| format!("--rounds: {e}"))?;
                i += 1;
            }
            "--sample" => {
                a.sample = value(i)?.parse().map_err(|e| format!("--sample: {e}"))?;
                i += 1;
            }
            "--indexes" => {
                a.indexes = value(i)?.split(',').map(|s| s.trim().to_string()).collect();
                i += 1;
            }
            "--no-memory" => a.memory = false,
            "--no-peers" => a.peers = false,
            "--threads" => {
                a.threads = value(i)?
                    .split(',')
                    .map(|x| x.trim().parse().map_err(|e| format!("--threads: {e}")))
                    .collect::<Result<_, _>>()?;
                i += 1;
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
        i += 1;
    }
    for name in &a.indexes {
        if !peers::NAMES.contains(&name.as_str()) {
            return Err(format!("unknown index {name:?}; known: {:?}", peers::NAMES));
        }
    }
    Ok(a)
}

/// Resident bytes of this process.
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc_page_size() }
}

extern "C" {
    fn sysconf(name: i32) -> i64;
}

/// `sysconf(_SC_PAGESIZE)` (30 on Linux).
unsafe fn libc_page_size() -> usize {
    // SAFETY: the caller's; sysconf reads a constant.
    let size = unsafe { sysconf(30) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}

/// How a replay looks up.
#[derive(Clone, Copy, PartialEq)]
enum Lookups {
    Skip,
    Timed(Answer),
}

/// Replays the stream on `index` (fresh); returns the replay's seconds and each lookup's ns.
fn replay(index: &mut dyn Index, w: &Workload, lookups: Lookups) -> (f64, Vec<u32>) {
    index.reset();
    index.prepare();
    let mut latencies = Vec::with_capacity(w.lookups());
    let mut batch = 0;
    let start = Instant::now();
    for step in &w.steps {
        match *step {
            Step::Apply { .. } => {
                index.apply(batch);
                batch += 1;
            }
            Step::Lookup { chain } => {
                if let Lookups::Timed(answer) = lookups {
                    index.settle();
                    let t = Instant::now();
                    std::hint::black_box(index.lookup(chain as usize, answer));
                    latencies.push(t.elapsed().as_nanos() as u32);
                }
            }
        }
    }
    index.settle();
    (start.elapsed().as_secs_f64(), latencies)
}

/// Replays with every `sample`-th lookup's answer checked against the reference.
fn check(index: &mut dyn Index, w: &Workload, sample: usize) -> Result<usize, String> {
    index.reset();
    index.prepare();
    let mut reference = reference::Reference::default();
    let mut batch = 0;
    let mut checked = 0;
    for (k, step) in w.steps.iter().enumerate() {
        match *step {
            Step::Apply {
                instance,
                ref events,
                ..
            } => {
                index.apply(batch);
                reference.apply(instance, events);
                batch += 1;
            }
            Step::Lookup { chain } => {
                if chain as usize % sample.max(1) != 0 && k + 2 < w.steps.len() {
                    continue;
                }
                let want = reference.lookup(&w.chains[chain as usize]);
                index.settle();
                let got = index.answer(chain as usize);
                if got != want {
                    let diff: Vec<_> = got
                        .iter()
                        .filter(|x| !want.contains(x))
                        .chain(want.iter().filter(|x| !got.contains(x)))
                        .take(6)
                        .collect();
                    return Err(format!(
                        "lookup {chain}: {} rows, the reference {} (first differences {diff:?})",
                        got.len(),
                        want.len()
                    ));
                }
                checked += 1;
            }
        }
    }
    Ok(checked)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0
}

#[derive(Default)]
struct Figures {
    apply_s: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
    rows_p50: Vec<f64>,
    rows_p99: Vec<f64>,
    bytes_per_entry: Option<f64>,
}

fn memory_child(name: &str, file: &str) -> Result<(), String> {
    let w = workload::load(std::path::Path::new(file)).map_err(|e| e.to_string())?;
    let mut index = peers::make(name, &w).ok_or("unknown index")?;
    let before = rss();
    index.reset();
    let mut batch = 0;
    for step in &w.steps {
        match *step {
            Step::Apply { .. } => {
                index.apply(batch);
                batch += 1;
            }
            Step::Lookup { chain } => {
                index.settle();
                std::hint::black_box(index.lookup(chain as usize, Answer::Compact));
            }
        }
    }
    index.settle();
    let after = rss();
    println!("rss_growth {}", after.saturating_sub(before));
    println!("breakdown {}", index.breakdown());
    std::hint::black_box(&index);
    Ok(())
}

fn memory_of(name: &str, file: &std::path::Path) -> Result<usize, String> {
    let out = std::process::Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
        .arg("memory")
        .arg(name)
        .arg(file)
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("rss_growth "))
        .and_then(|x| x.trim().parse().ok())
        .ok_or_else(|| {
            format!(
                "memory child of {name} failed: {}{}",
                text,
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

fn run(args: Args) -> Result<(), String> {
    let trace = workload::load_trace(&workload::trace_path())?;
    let mut summary = Vec::new();
    for &n in &args.instances {
        let t = Instant::now();
        let w = workload::generate(&trace, n);
        let (entries, blocks) = reference::final_state(&w);
        eprintln!(
            "{n} instances: {} requests, {} events, {} event blocks, {} live entries on {} blocks \
             at the end (generated in {:.1} s)",
            w.lookups(),
            w.events(),
            w.event_blocks(),
            entries,
            blocks,
            t.elapsed().as_secs_f64()
        );
        let mut indexes: Vec<(String, Box<dyn Index>)> = args
            .indexes
            .iter()
            .map(|name| (name.clone(), peers::make(name, &w).expect("known")))
            .collect();
        for (name, index) in &mut indexes {
            let checked = check(index.as_mut(), &w, args.sample)
                .map_err(|e| format!("{name} at {n} instances disagrees: {e}"))?;
            eprintln!("  {name}: {checked} sampled lookups agree with the reference");
        }
        let mut figures: Vec<Figures> = indexes.iter().map(|_| Figures::default()).collect();
        for round in 0..args.rounds {
            for k in 0..indexes.len() {
                let i = (k + round) % indexes.len();
                let index = indexes[i].1.as_mut();
                let f = &mut figures[i];
                f.apply_s.push(replay(index, &w, Lookups::Skip).0);
                let (_, mut lat) = replay(index, &w, Lookups::Timed(Answer::Compact));
                lat.sort_unstable();
                f.p50.push(percentile(&lat, 0.5));
                f.p99.push(percentile(&lat, 0.99));
                if index.compact() {
                    let (_, mut lat) = replay(index, &w, Lookups::Timed(Answer::Rows));
                    lat.sort_unstable();
                    f.rows_p50.push(percentile(&lat, 0.5));
                    f.rows_p99.push(percentile(&lat, 0.99));
                }
            }
            eprintln!("  round {} of {} done", round + 1, args.rounds);
        }
        drop(indexes);
        if args.memory {
            let file =
                std::env::temp_dir().join(format!("index_peers_{n}_{}.bin", std::process::id()));
            workload::save(&w, &file).map_err(|e| e.to_string())?;
            for (i, name) in args.indexes.iter().enumerate() {
                let growth = memory_of(name, &file)?;
                figures[i].bytes_per_entry = Some(growth as f64 / entries as f64);
            }
            let _ = std::fs::remove_file(&file);
        }
        summary.push((n, w.events(), w.event_blocks(), entries, figures));
    }
    print_summary(&args, &summary);
    Ok(())
}

#[allow(clippy::type_complexity)]
fn print_summary(args: &Args, summary: &[(usize, usize, usize, usize, Vec<Figures>)]) {
    println!(
        "\nmedians of {} interleaved rounds; lookups timed one by one between the batches; \
         ratio = index / kvpool (apply: kvpool's time / the index's)",
        args.rounds
    );
    println!(
        "| instances | index | apply, M events/s | apply, M blocks/s | apply vs kvpool | lookup p50 / p99 us | rows p50 / p99 us | bytes per live entry |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (n, events, blocks, _entries, figures) in summary {
        let kv = args.indexes.iter().position(|x| x == "kvpool");
        let kv_apply = kv.map(|k| median(figures[k].apply_s.clone()));
        for (i, f) in figures.iter().enumerate() {
            let apply = median(f.apply_s.clone());
            let ratio = kv_apply.map_or(String::from("-"), |k| format!("{:.2}x", k / apply));
            let rows = if f.rows_p50.is_empty() {
                String::from("-")
            } else {
                format!(
                    "{:.2} / {:.1}",
                    median(f.rows_p50.clone()),
                    median(f.rows_p99.clone())
                )
            };
            println!(
                "| {n} | {} | {:.2} | {:.2} | {ratio} | {:.2} / {:.1} | {rows} | {} |",
                args.indexes[i],
                *events as f64 / apply / 1e6,
                *blocks as f64 / apply / 1e6,
                median(f.p50.clone()),
                median(f.p99.clone()),
                f.bytes_per_entry
                    .map_or(String::from("-"), |b| format!("{b:.0}")),
            );
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if args.first().map(String::as_str) == Some("memory") && args.len() == 3 {
        memory_child(&args[1], &args[2])
    } else if args.first().map(String::as_str) == Some("save") && args.len() == 3 {
        // `save <instances> <file>`: the stream, for a memory child run by hand.
        args[1]
            .parse()
            .map_err(|e| format!("instances: {e}"))
            .and_then(|n| {
                let trace = workload::load_trace(&workload::trace_path())?;
                workload::save(
                    &workload::generate(&trace, n),
                    std::path::Path::new(&args[2]),
                )
                .map_err(|e| e.to_string())
            })
    } else if args.first().map(String::as_str) == Some("writers") {
        parse_args(&args[1..]).and_then(|a| {
            let trace = workload::load_trace(&workload::trace_path())?;
            for &n in &a.instances {
                let w = workload::generate(&trace, n);
                writers::run(&w, &a.threads, a.rounds, a.peers);
            }
            Ok(())
        })
    } else {
        parse_args(&args).and_then(run)
    };
    if let Err(e) = result {
        eprintln!("index_peers: {e}");
        std::process::exit(1);
    }
}
