//! Resident memory and CPU time of a process, from `/proc` (Linux).

use std::path::PathBuf;

/// Why a `/proc` file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// The file could not be read (the process is gone?).
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The file did not have the expected field.
    #[error("{path}: no field {field}")]
    Field {
        /// The file.
        path: PathBuf,
        /// The missing field.
        field: &'static str,
    },
}

fn read(pid: u32, file: &str) -> Result<(PathBuf, String), ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/{file}"));
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok((path, text)),
        Err(source) => Err(ProcError::Read { path, source }),
    }
}

/// A `kB` field of `/proc/PID/status`, in bytes.
fn status_kb(pid: u32, field: &'static str) -> Result<u64, ProcError> {
    let (path, text) = read(pid, "status")?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or(ProcError::Field { path, field })
}

/// Resident set size (`VmRSS`), in bytes.
pub fn rss_bytes(pid: u32) -> Result<u64, ProcError> {
    status_kb(pid, "VmRSS")
}

/// Peak resident set size (`VmHWM`), in bytes.
pub fn peak_rss_bytes(pid: u32) -> Result<u64, ProcError> {
    status_kb(pid, "VmHWM")
}

/// `pid` and every process descended from it (children, their children,
/// ...), from the parent ids in `/proc/*/stat`: the processes a gateway
/// started (worker processes) count as its own.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(child) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if let Ok((_, text)) = read(child, "stat")
                && let Some(ppid) = stat_field(&text, 4)
            {
                parents.push((child, ppid as u32));
            }
        }
    }
    let mut tree = vec![pid];
    let mut i = 0;
    while let Some(&p) = tree.get(i) {
        tree.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    tree
}

/// Field `n` (1-based, as `proc(5)` numbers them) of a `/proc/PID/stat`
/// text; fields from 3 on follow the command name's `)`.
fn stat_field(text: &str, n: usize) -> Option<u64> {
    let rest = text.rsplit_once(')')?.1;
    rest.split_whitespace().nth(n.checked_sub(3)?)?.parse().ok()
}

/// Threads of the process.
pub fn threads(pid: u32) -> Result<u64, ProcError> {
    let (path, text) = read(pid, "status")?;
    text.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or(ProcError::Field {
            path,
            field: "Threads",
        })
}

/// Context switches so far of every thread of `pid`, voluntary and
/// involuntary together (`voluntary_ctxt_switches` and
/// `nonvoluntary_ctxt_switches` of each `/proc/PID/task/TID/status`; a
/// thread that ended takes its count with it).
pub fn context_switches(pid: u32) -> Result<u64, ProcError> {
    let dir = PathBuf::from(format!("/proc/{pid}/task"));
    let tasks = std::fs::read_dir(&dir).map_err(|source| ProcError::Read {
        path: dir.clone(),
        source,
    })?;
    let mut total = 0;
    for task in tasks.flatten() {
        // A thread may end between the listing and the read.
        let Ok(text) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        total += switches_in_status(&text);
    }
    Ok(total)
}

/// The voluntary plus involuntary context switches a `status` file says.
fn switches_in_status(text: &str) -> u64 {
    text.lines()
        .filter_map(|l| {
            l.strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
        })
        .filter_map(|v| v.trim().parse::<u64>().ok())
        .sum()
}

/// User plus system CPU time (`utime + stime` of `/proc/PID/stat`), in
/// clock ticks.
pub fn cpu_ticks(pid: u32) -> Result<u64, ProcError> {
    let (path, text) = read(pid, "stat")?;
    // The command name may hold spaces; fields resume after its `)`:
    // utime is field 14, stime field 15.
    match (stat_field(&text, 14), stat_field(&text, 15)) {
        (Some(u), Some(s)) => Ok(u + s),
        _ => Err(ProcError::Field {
            path,
            field: "utime/stime",
        }),
    }
}

/// The system's load averages over 1, 5 and 15 minutes (`/proc/loadavg`):
/// how busy the machine was around a run, other jobs included.
pub fn load_average() -> Result<[f64; 3], ProcError> {
    let path = PathBuf::from("/proc/loadavg");
    let text = std::fs::read_to_string(&path).map_err(|source| ProcError::Read {
        path: path.clone(),
        source,
    })?;
    let mut fields = text.split_whitespace().map(|v| v.parse::<f64>().ok());
    match (fields.next(), fields.next(), fields.next()) {
        (Some(Some(one)), Some(Some(five)), Some(Some(fifteen))) => Ok([one, five, fifteen]),
        _ => Err(ProcError::Field {
            path,
            field: "load averages",
        }),
    }
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`); 100 on every Linux
/// the project runs on (USER_HZ is fixed by the kernel ABI).
pub const TICKS_PER_SECOND: u64 = 100;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_has_rss_and_cpu_time() {
        let pid = std::process::id();
        assert!(rss_bytes(pid).unwrap() > 0);
        assert!(peak_rss_bytes(pid).unwrap() >= rss_bytes(pid).unwrap() / 2);
        assert!(threads(pid).unwrap() >= 1);
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        cpu_ticks(pid).unwrap();
        assert!(load_average().unwrap().iter().all(|l| *l >= 0.0));
    }

    #[test]
    fn context_switches_count_every_thread() {
        let status = "Name:\tx\nvoluntary_ctxt_switches:\t7\nnonvoluntary_ctxt_switches:\t3\n";
        assert_eq!(switches_in_status(status), 10);
        assert_eq!(switches_in_status("Name:\tx\n"), 0);
        let pid = std::process::id();
        let before = context_switches(pid).unwrap();
        // A thread that sleeps switches at least once, and it is counted
        // while it lives.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let sleeper = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(5));
            let _ = rx.recv();
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        let during = context_switches(pid).unwrap();
        let _ = tx.send(());
        sleeper.join().unwrap();
        assert!(during > before, "{before} -> {during}");
    }

    #[test]
    fn a_process_tree_holds_the_process_and_its_children() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let tree = process_tree(std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(tree[0], std::process::id());
        assert!(tree.contains(&child.id()), "{tree:?}");
    }

    #[test]
    fn a_missing_process_is_a_read_error() {
        assert!(matches!(rss_bytes(u32::MAX), Err(ProcError::Read { .. })));
    }
}
