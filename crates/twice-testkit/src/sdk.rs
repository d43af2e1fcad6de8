//! The official Service Bus SDKs for tests that drive a server with them: a Python venv with
//! `azure-servicebus` and a directory with `node_modules` for `@azure/service-bus`.
//!
//! Each environment is made once per machine for a given pin file, in a cache directory named
//! after the file's content: the suites of every crate and checkout with the same pins share
//! it, and a change of pins makes a new one. Making one is idempotent and safe to race: threads
//! and processes take turns on a lock, and an environment counts as made only once its
//! installer succeeded. A failed installer leaves nothing behind and is reported with its
//! command and output.
//!
//! ```no_run
//! use twice_testkit::sdk::Sdks;
//!
//! let python = Sdks::machine().python("tests/python/requirements.txt".as_ref())?;
//! let js_dir = Sdks::machine().node("tests/js/package.json".as_ref())?;
//! // Scripts run from a directory of their own that sees the installed packages.
//! let work = Sdks::node_workdir(&js_dir)?;
//! std::fs::copy("tests/js/servicebus.test.mjs", work.path().join("servicebus.test.mjs"))
//!     .expect("copy the script");
//! # let _ = python;
//! # Ok::<(), twice_testkit::sdk::SdkError>(())
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Why an SDK environment could not be made.
#[derive(Debug)]
#[non_exhaustive]
pub enum SdkError {
    /// A file or directory could not be read or written.
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// A tool (`python3`, `pip`, `npm`) could not be started: it is probably not installed.
    ToolMissing {
        /// The command.
        command: String,
        /// The error.
        source: std::io::Error,
    },
    /// A tool ran and failed.
    ToolFailed {
        /// The command.
        command: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it wrote to stdout and stderr.
        output: String,
    },
}

impl std::fmt::Display for SdkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SdkError::Io { what, source } => write!(f, "{what}: {source}"),
            SdkError::ToolMissing { command, source } => {
                write!(f, "cannot run `{command}` (is it installed?): {source}")
            }
            SdkError::ToolFailed { command, status, output } => {
                write!(f, "`{command}` failed ({status}):\n{output}")
            }
        }
    }
}

impl std::error::Error for SdkError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SdkError::Io { source, .. } | SdkError::ToolMissing { source, .. } => Some(source),
            SdkError::ToolFailed { .. } => None,
        }
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SdkError {
    let what = what.into();
    move |source| SdkError::Io { what, source }
}

/// Where SDK environments are made.
#[derive(Clone, Debug)]
pub struct Sdks {
    root: PathBuf,
}

impl Sdks {
    /// The machine's cache: `$XDG_CACHE_HOME/twice-sdk`, else `$HOME/.cache/twice-sdk`, else
    /// `twice-sdk` in the temporary directory.
    pub fn machine() -> Self {
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(std::env::temp_dir);
        Self::in_dir(cache.join("twice-sdk"))
    }

    /// Environments under `root`.
    pub fn in_dir(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The directory the environments are made in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The Python interpreter of a venv with the packages `requirements` pins (a pip
    /// requirements file), made on first use.
    ///
    /// # Errors
    ///
    /// When the file cannot be read, or `python3 -m venv` or `pip install` fails.
    pub fn python(&self, requirements: &Path) -> Result<PathBuf, SdkError> {
        self.make("python", requirements, |venv, _| {
            run(Command::new("python3").args(["-m", "venv"]).arg(venv))?;
            run(Command::new(venv.join("bin/python"))
                .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r"])
                .arg(requirements))
        })
        .map(|venv| venv.join("bin/python"))
    }

    /// A directory with `package.json` and the `node_modules` it pins, made on first use with
    /// `npm install`.
    ///
    /// # Errors
    ///
    /// When the file cannot be read or `npm install` fails.
    pub fn node(&self, package_json: &Path) -> Result<PathBuf, SdkError> {
        self.make("node", package_json, |dir, spec| {
            let manifest = dir.join("package.json");
            std::fs::write(&manifest, spec)
                .map_err(io(format!("writing {}", manifest.display())))?;
            run(Command::new("npm")
                .args(["install", "--no-audit", "--no-fund", "--loglevel=error"])
                .current_dir(dir))?;
            // npm makes no `node_modules` for a manifest without dependencies; a script's
            // directory links to it all the same.
            let modules = dir.join("node_modules");
            std::fs::create_dir_all(&modules).map_err(io(format!("creating {}", modules.display())))
        })
    }

    /// A fresh directory, removed on drop, in which Node resolves the packages of `node_dir`
    /// (made by [`Sdks::node`]): its `node_modules` links to theirs. A test copies its script
    /// here, not into the environment, which other suites and checkouts use at the same time.
    ///
    /// # Errors
    ///
    /// When the directory or the link cannot be made.
    pub fn node_workdir(node_dir: &Path) -> Result<tempfile::TempDir, SdkError> {
        let work = tempfile::Builder::new()
            .prefix("twice-node-")
            .tempdir()
            .map_err(io("creating a directory for a Node script"))?;
        let link = work.path().join("node_modules");
        std::os::unix::fs::symlink(node_dir.join("node_modules"), &link)
            .map_err(io(format!("linking {}", link.display())))?;
        std::fs::copy(node_dir.join("package.json"), work.path().join("package.json"))
            .map_err(io("copying package.json"))?;
        Ok(work)
    }

    /// The environment `kind` for the pin file `spec_path`: made by `install` in a fresh
    /// directory unless a finished one is there.
    fn make(
        &self,
        kind: &str,
        spec_path: &Path,
        install: impl FnOnce(&Path, &str) -> Result<(), SdkError>,
    ) -> Result<PathBuf, SdkError> {
        let spec = std::fs::read_to_string(spec_path)
            .map_err(io(format!("reading {}", spec_path.display())))?;
        let name = format!("{kind}-{:016x}", fnv1a(spec.as_bytes()));
        let dir = self.root.join(&name);
        let ready = dir.join(".ready");
        with_lock(&self.root, &name, || {
            if std::fs::read_to_string(&ready).ok().as_deref() == Some(spec.as_str()) {
                return Ok(dir.clone());
            }
            // Whatever is there is the rest of an install that did not finish.
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
            if let Err(e) = install(&dir, &spec) {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
            std::fs::write(&ready, &spec).map_err(io(format!("writing {}", ready.display())))?;
            Ok(dir.clone())
        })?
    }
}

/// FNV-1a, 64 bits: names an environment after its pins (not a security boundary).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

fn run(cmd: &mut Command) -> Result<(), SdkError> {
    let command = format!("{cmd:?}");
    let out = cmd
        .output()
        .map_err(|source| SdkError::ToolMissing { command: command.clone(), source })?;
    if out.status.success() {
        return Ok(());
    }
    Err(SdkError::ToolFailed {
        command,
        status: out.status,
        output: format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    })
}

/// Runs `f` holding an exclusive lock named `name` in `dir`, so parallel tests make an
/// environment once. Threads of this process take turns on a mutex; processes take turns on a
/// lock file created with its owner's pid (a hard link, so it appears with its content), and a
/// lock file whose owner is gone is taken over.
fn with_lock<T>(dir: &Path, name: &str, f: impl FnOnce() -> T) -> Result<T, SdkError> {
    static IN_PROCESS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = IN_PROCESS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    let path = dir.join(format!("{name}.lock"));
    let mine = dir.join(format!("{name}.lock.{}", std::process::id()));
    std::fs::write(&mine, std::process::id().to_string())
        .map_err(io(format!("writing {}", mine.display())))?;
    loop {
        if std::fs::hard_link(&mine, &path).is_ok() {
            break;
        }
        let owner = std::fs::read_to_string(&path).unwrap_or_default();
        // Our own pid here is a leftover: no other thread of ours is past the mutex.
        let alive = !owner.trim().is_empty()
            && owner.trim() != std::process::id().to_string()
            && Path::new(&format!("/proc/{}", owner.trim())).exists();
        if !alive {
            let _ = std::fs::remove_file(&path);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = f();
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&mine);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pins(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Entries of the cache other than lock files.
    fn environments(root: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.contains(".lock"))
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_failed_pip_install_names_its_command_shows_its_output_and_leaves_nothing() {
        let scratch = tempfile::tempdir().unwrap();
        let sdks = Sdks::in_dir(scratch.path().join("cache"));
        let requirements = pins(scratch.path(), "requirements.txt", "not a requirement !!\n");
        for attempt in 0..2 {
            let err = sdks.python(&requirements).expect_err("pip cannot read these pins");
            let SdkError::ToolFailed { command, output, .. } = &err else {
                panic!("attempt {attempt}: {err}");
            };
            assert!(command.contains("pip") && command.contains("install"), "{command}");
            assert!(output.contains("Invalid requirement"), "pip's own words: {output}");
            assert!(err.to_string().contains("Invalid requirement"), "{err}");
            // A failed install is not taken for a made environment by the next attempt.
            assert_eq!(environments(sdks.root()), Vec::<String>::new());
        }
    }

    #[test]
    fn a_failed_npm_install_is_an_error_with_npms_output() {
        let scratch = tempfile::tempdir().unwrap();
        let sdks = Sdks::in_dir(scratch.path().join("cache"));
        let manifest = pins(scratch.path(), "package.json", "{ this is not json");
        let err = sdks.node(&manifest).expect_err("npm cannot read this manifest");
        let SdkError::ToolFailed { command, output, .. } = &err else { panic!("{err}") };
        assert!(command.contains("npm"), "{command}");
        assert!(output.contains("JSON"), "npm's own words: {output}");
        assert_eq!(environments(sdks.root()), Vec::<String>::new());
    }

    #[test]
    fn a_missing_pin_file_is_an_io_error_that_names_it() {
        let scratch = tempfile::tempdir().unwrap();
        let err = Sdks::in_dir(scratch.path()).node(&scratch.path().join("nope.json")).unwrap_err();
        assert!(matches!(err, SdkError::Io { .. }), "{err}");
        assert!(err.to_string().contains("nope.json"), "{err}");
    }

    #[test]
    fn an_environment_is_made_once_for_racing_callers_and_anew_for_other_pins() {
        let scratch = tempfile::tempdir().unwrap();
        let sdks = Sdks::in_dir(scratch.path().join("cache"));
        // No dependencies: npm makes the environment without the network.
        let manifest = pins(scratch.path(), "package.json", r#"{"name":"a","private":true}"#);
        let made: Vec<PathBuf> = std::thread::scope(|s| {
            let racers: Vec<_> = (0..4).map(|_| s.spawn(|| sdks.node(&manifest))).collect();
            racers.into_iter().map(|r| r.join().unwrap().unwrap()).collect()
        });
        assert!(made.iter().all(|d| *d == made[0]), "{made:?}");
        assert_eq!(environments(sdks.root()).len(), 1);
        // A made environment is used as it is: a file put in it stays.
        let mark = made[0].join("mark");
        std::fs::write(&mark, "kept").unwrap();
        assert_eq!(sdks.node(&manifest).unwrap(), made[0]);
        assert!(mark.exists(), "the second call made the environment again");

        // Other pins, another environment; the first stays.
        std::fs::write(&manifest, r#"{"name":"b","private":true}"#).unwrap();
        let other = sdks.node(&manifest).unwrap();
        assert_ne!(other, made[0]);
        assert_eq!(environments(sdks.root()).len(), 2);
        assert!(mark.exists());

        // A script's directory sees the environment's packages and leaves it alone.
        let work = Sdks::node_workdir(&other).unwrap();
        assert!(work.path().join("node_modules").exists());
        assert!(work.path().join("package.json").exists());
        let work_path = work.path().to_owned();
        drop(work);
        assert!(!work_path.exists() && other.join("node_modules").exists());
    }
}
