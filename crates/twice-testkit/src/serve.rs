//! `twice serve` as a child process: started on free ports, read until its banner says it is
//! ready, its output kept for the test, and killed on drop.
//!
//! ```no_run
//! use twice_testkit::serve::ServeProcess;
//!
//! # fn binary() -> &'static str { "target/debug/twice" }
//! // In a test of the `twice-cli` package: `ServeProcess::start(env!("CARGO_BIN_EXE_twice"), …)`.
//! let serve = ServeProcess::start(binary(), &["--in-memory"]);
//! let connection_string = serve.connection_string().expect("printed for the default key").to_owned();
//! assert_eq!(serve.get("/health").status, 200);
//! let stopped = serve.terminate();
//! assert!(stopped.status.success(), "{}", stopped.stderr);
//! # let _ = connection_string;
//! ```

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;

use twice_servicebus_client::http;

/// A running `twice serve`, killed (SIGKILL) on drop if still running.
#[derive(Debug)]
pub struct ServeProcess {
    child: Child,
    banner: Vec<String>,
    /// What it prints to stdout after the banner, collected until it ends.
    stdout: Option<JoinHandle<String>>,
    /// What it prints to stderr, collected until it ends.
    stderr: Option<JoinHandle<String>>,
}

/// An answer of the HTTP port: its status and its body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The body, as text.
    pub body: String,
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.body)
    }
}

/// What a stopped `twice serve` left: its exit status and its output after the banner.
#[derive(Debug)]
pub struct Stopped {
    /// How it ended.
    pub status: ExitStatus,
    /// Standard output after the banner.
    pub stdout: String,
    /// Standard error, all of it.
    pub stderr: String,
}

impl ServeProcess {
    /// Starts `binary serve ARGS`, with the AMQP port and the HTTP port on free loopback ports
    /// unless `args` names them (`--amqp`, `--http`, `--no-http`), and waits for the banner's
    /// `ready in` line.
    ///
    /// # Panics
    ///
    /// When it cannot be started or ends before it is ready (the panic shows what it wrote).
    pub fn start(binary: impl AsRef<Path>, args: &[&str]) -> Self {
        Self::start_command(Command::new(binary.as_ref()), args)
    }

    /// [`ServeProcess::start`] with a command that runs the binary, such as a shell that
    /// lowers a limit first and then `exec`s it; `serve` and `args` are appended to it.
    ///
    /// # Panics
    ///
    /// As [`ServeProcess::start`].
    pub fn start_command(mut command: Command, args: &[&str]) -> Self {
        command.arg("serve");
        if !args.contains(&"--amqp") {
            command.args(["--amqp", "127.0.0.1:0"]);
        }
        if !args.contains(&"--http") && !args.contains(&"--no-http") {
            command.args(["--http", "127.0.0.1:0"]);
        }
        let mut child = command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
        // Both pipes are drained as long as it runs, so it never blocks on a full one.
        let mut err = child.stderr.take().expect("a piped stderr");
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text);
            text
        });
        let mut out = BufReader::new(child.stdout.take().expect("a piped stdout"));
        let mut banner = Vec::new();
        loop {
            let mut line = String::new();
            if out.read_line(&mut line).unwrap_or(0) == 0 {
                let _ = child.wait();
                let err = stderr.join().unwrap_or_default();
                panic!("twice serve ended before it was ready: {banner:?}\n{err}");
            }
            let ready = line.starts_with("ready in");
            banner.push(line.trim_end().to_owned());
            if ready {
                break;
            }
        }
        let stdout = std::thread::spawn(move || {
            let mut rest = String::new();
            let _ = out.read_to_string(&mut rest);
            rest
        });
        Self { child, banner, stdout: Some(stdout), stderr: Some(stderr) }
    }

    /// The lines it printed up to and including `ready in …`.
    pub fn banner(&self) -> &[String] {
        &self.banner
    }

    /// The connection string of the banner, as printed (with a key of the user's own, it names
    /// the key instead of showing it).
    pub fn connection_string(&self) -> Option<&str> {
        self.banner.iter().find_map(|l| l.strip_prefix("connection string: "))
    }

    /// The CA file of the HTTP port's development certificate, as the banner prints it for
    /// the SDKs' administration clients (`None` without one: `--tls-cert`, `--no-dev-https`).
    pub fn dev_ca(&self) -> Option<std::path::PathBuf> {
        self.banner.iter().find_map(|l| {
            let rest = l.trim_start().strip_prefix("Python: export REQUESTS_CA_BUNDLE=")?;
            rest.split_whitespace().next().map(std::path::PathBuf::from)
        })
    }

    /// The AMQP address of the banner's first line.
    ///
    /// # Panics
    ///
    /// When the first line names no address.
    pub fn amqp_addr(&self) -> SocketAddr {
        self.banner
            .first()
            .into_iter()
            .flat_map(|l| l.split_whitespace())
            .find_map(|w| w.trim_end_matches(',').parse().ok())
            .unwrap_or_else(|| panic!("no AMQP address in the banner: {:?}", self.banner))
    }

    /// The HTTP address (`host:port`) of the banner's `health` line.
    ///
    /// # Panics
    ///
    /// When it serves no HTTP port (`--no-http`).
    pub fn http_addr(&self) -> String {
        let url = self.http_url();
        url.split_once("://").map_or(url.as_str(), |(_, addr)| addr).to_owned()
    }

    /// The base URL of the HTTP port, `http://host:port` (`https://` with a certificate).
    ///
    /// # Panics
    ///
    /// As [`ServeProcess::http_addr`].
    pub fn http_url(&self) -> String {
        let line = self
            .banner
            .iter()
            .find(|l| l.starts_with("health"))
            .unwrap_or_else(|| panic!("no health line in the banner: {:?}", self.banner));
        let url = line.split_whitespace().find(|w| w.ends_with("/health")).expect("health url");
        url.trim_end_matches("/health").to_owned()
    }

    /// The answer to `GET path` on the HTTP port (plain http, on a connection of its own, within
    /// 30 s). It runs on a thread of its own, so a test may call it inside a runtime or outside.
    ///
    /// # Panics
    ///
    /// When the port cannot be reached or does not answer HTTP.
    pub fn get(&self, path: &str) -> Answer {
        let addr = self.http_addr();
        let (host, port) = addr.rsplit_once(':').expect("host:port");
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let target = http::Target::http(host, port.parse().expect("a port in the banner"));
        let request = http::Request::get(path).max_body(16 << 20);
        let got = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(http::request(&target, request)).map_err(std::io::Error::other)
        })
        .join()
        .expect("the request's thread");
        let answer = got.unwrap_or_else(|e| panic!("GET {path} on {addr}: {e}"));
        Answer { status: answer.status().as_u16(), body: answer.text() }
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Whether it is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends SIGTERM, as a service manager stops a service, and waits for it to end.
    ///
    /// # Panics
    ///
    /// When the signal cannot be sent or the process cannot be waited for.
    pub fn terminate(self) -> Stopped {
        let status = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        assert!(status.is_ok_and(|s| s.success()), "sending SIGTERM to twice serve");
        self.wait()
    }

    /// Waits for it to end by itself.
    ///
    /// # Panics
    ///
    /// When the process cannot be waited for.
    pub fn wait(mut self) -> Stopped {
        let status = self.child.wait().expect("waiting for twice serve");
        let join =
            |h: Option<JoinHandle<String>>| h.and_then(|h| h.join().ok()).unwrap_or_default();
        Stopped { status, stdout: join(self.stdout.take()), stderr: join(self.stderr.take()) }
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        // A test that failed half-way leaves no process behind.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
