//! Which routes a WAL directory last kept in the broker: the routes whose
//! local copies mirror a broker-kept store (released at start, not fired),
//! as opposed to messages only this WAL holds.

use std::collections::HashSet;
use std::sync::Mutex;

/// The file in the WAL directory naming, one per line, the routes whose
/// state that WAL kept in the broker when it was last used.
pub const MIRRORED_FILE: &str = "store-broker-routes";

/// Routes marked by [`mark_mirrored`] (none if the file is missing).
pub fn mirrored_routes(wal_dir: &std::path::Path) -> anyhow::Result<HashSet<String>> {
    let path = wal_dir.join(MIRRORED_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(text.lines().map(str::to_owned).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HashSet::new()),
        Err(e) => Err(anyhow::Error::new(e).context(format!("cannot read {}", path.display()))),
    }
}

/// Record that the WAL in `wal_dir` now mirrors these routes' state topics
/// (written whole, then renamed, then the directory synced).
/// Add `route` to the routes marked in `wal_dir` (see [`mark_mirrored`]).
pub fn add_mirrored(wal_dir: &std::path::Path, route: &str) -> anyhow::Result<()> {
    // One read-modify-write at a time: routes drain concurrently.
    static MARKING: Mutex<()> = Mutex::new(());
    let _one = MARKING.lock().unwrap_or_else(|e| e.into_inner());
    let mut routes = mirrored_routes(wal_dir)?;
    if routes.insert(route.to_owned()) {
        let routes: Vec<&str> = routes.iter().map(String::as_str).collect();
        mark_mirrored(wal_dir, &routes)?;
    }
    Ok(())
}

pub fn mark_mirrored(wal_dir: &std::path::Path, routes: &[&str]) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let mut routes = routes.to_vec();
    routes.sort_unstable();
    let path = wal_dir.join(MIRRORED_FILE);
    let tmp = wal_dir.join(format!("{MIRRORED_FILE}.tmp"));
    let mut file =
        std::fs::File::create(&tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
    for route in routes {
        writeln!(file, "{route}")?;
    }
    file.sync_all()?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::File::open(wal_dir)?.sync_all()?;
    Ok(())
}
