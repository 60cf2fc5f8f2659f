//! The crash tests' child processes: the test binary runs itself again
//! (one test, `--exact`) as a child it kills with SIGKILL, and the child
//! tells the parent what was acknowledged, one line at a time on stdout.
//! Included by path from the crash tests, which need nothing else of
//! `common`.

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdout, Command, Stdio};

/// Start this test binary again as a child running only `test`, with
/// `env_key` set to `dir`. Returns it and its stdout, line by line.
pub fn spawn(
    test: &str,
    env_key: &str,
    dir: &std::path::Path,
) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut child = Command::new(std::env::current_exe().expect("own path"))
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(env_key, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the child");
    let lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    (child, lines)
}

/// Print one line straight into the pipe (the lock per line lets several
/// threads print), so the parent has it even if a kill follows at once.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").expect("stdout");
    out.flush().expect("stdout");
}
