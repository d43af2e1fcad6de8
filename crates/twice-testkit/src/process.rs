//! Child processes for crash tests: a crate's example binary, rebuilt when it is older than
//! what it is built from, and a child that is killed with SIGKILL.

use std::io::{BufRead, BufReader, Lines};
use std::path::{Path, PathBuf};
use std::process::{ChildStdout, Command, Stdio};

/// The path of example `name` of `package`, whose manifest is in `manifest_dir` (pass
/// `env!("CARGO_MANIFEST_DIR")`), built with `features` of the package when it has to be built
/// (the example's `required-features`; `&[]` for none).
///
/// `cargo test -p <package>` builds examples next to the test binary. When the example is
/// missing there, or older than the package's library or its own source (a run limited with
/// `--test it` builds neither), it is built into a separate target directory, since the cargo
/// running the test holds the lock of the main one. A test therefore never runs a stale child.
///
/// # Panics
///
/// When the test executable's directory cannot be found or the build fails.
pub fn example_bin(manifest_dir: &str, package: &str, name: &str, features: &[&str]) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/it-<hash> → target/<profile>/examples/<name>
    let profile_dir = exe.parent().and_then(Path::parent).expect("target profile directory");
    let path = profile_dir.join("examples").join(name);
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let source = Path::new(manifest_dir).join("examples").join(format!("{name}.rs"));
    let lib_prefix = format!("lib{}-", package.replace('-', "_"));
    let newest_lib = std::fs::read_dir(profile_dir.join("deps"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let file = e.file_name().to_string_lossy().into_owned();
            file.starts_with(&lib_prefix) && file.ends_with(".rlib")
        })
        .filter_map(|e| modified(&e.path()))
        .max();
    let inputs = [modified(&source), newest_lib].into_iter().flatten().max();
    if let Some(built) = modified(&path)
        && inputs.is_none_or(|newest| built >= newest)
    {
        return path;
    }
    let release = profile_dir.file_name().is_some_and(|p| p == "release");
    let target = profile_dir.parent().expect("target directory").join("example-children");
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--quiet", "-p", package, "--example", name])
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(manifest_dir);
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status().expect("run cargo build");
    assert!(status.success(), "building example {name} of {package} failed");
    target.join(if release { "release" } else { "debug" }).join("examples").join(name)
}

/// A running child whose standard output is read line by line. Dropped, it is killed.
#[derive(Debug)]
pub struct Child {
    child: std::process::Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Child {
    /// Starts `cmd` with its standard output piped to the test (its standard error is the
    /// test's).
    ///
    /// # Panics
    ///
    /// When the process cannot be started.
    pub fn spawn(cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let stdout = child.stdout.take().expect("a piped stdout");
        Self { child, lines: BufReader::new(stdout).lines() }
    }

    /// The next line the child printed; `None` once it closed its output.
    pub fn next_line(&mut self) -> Option<String> {
        self.lines.next().and_then(Result::ok)
    }

    /// Kills the child with SIGKILL (no destructor, flush or shutdown of its runs), waits for
    /// it, and returns the lines it printed before the kill landed.
    ///
    /// # Panics
    ///
    /// When the child cannot be killed or waited for.
    pub fn kill(mut self) -> Vec<String> {
        // `kill` sends SIGKILL on Unix.
        self.child.kill().expect("kill the child");
        let rest = self.lines.by_ref().map_while(Result::ok).collect();
        self.child.wait().expect("wait for the child");
        rest
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        // A test that failed half-way leaves no process behind; after `kill` this finds the
        // child already reaped and does nothing.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A shell command that restarts a server of the machine (RabbitMQ, NATS), and the address the
/// server answers on once it is back.
#[derive(Clone, Debug)]
pub struct ServerRestart {
    command: String,
    addr: String,
}

impl ServerRestart {
    /// How long [`ServerRestart::run`] waits for the server to answer again.
    pub const BOUND: std::time::Duration = std::time::Duration::from_secs(60);

    /// `command` is run with `sh -c`; `addr` is `host:port`.
    pub fn new(command: impl Into<String>, addr: impl Into<String>) -> Self {
        Self { command: command.into(), addr: addr.into() }
    }

    /// The address the server answers on.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The command.
    pub fn command(&self) -> &str {
        &self.command
    }

    /// Runs the command, then waits until the address accepts a TCP connection again.
    ///
    /// # Errors
    ///
    /// When the command cannot be run or fails, or the server does not answer within
    /// [`ServerRestart::BOUND`].
    pub async fn run(&self) -> std::io::Result<()> {
        let command = self.command.clone();
        let status = tokio::task::spawn_blocking(move || {
            Command::new("sh").arg("-c").arg(&command).stdin(Stdio::null()).status()
        })
        .await
        .map_err(std::io::Error::other)??;
        if !status.success() {
            return Err(std::io::Error::other(format!("`{}` failed: {status}", self.command)));
        }
        let clock = twice::SharedClock::system();
        let until = clock.now() + Self::BOUND;
        loop {
            match tokio::net::TcpStream::connect(&self.addr).await {
                Ok(_) => return Ok(()),
                Err(e) if clock.now() >= until => {
                    return Err(std::io::Error::other(format!(
                        "{} does not answer {:?} after the restart: {e}",
                        self.addr,
                        Self::BOUND
                    )));
                }
                Err(_) => clock.sleep(std::time::Duration::from_millis(200)).await,
            }
        }
    }
}
