//! Counts the commands clients send to a Redis, the way an operator would: `MONITOR`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex};

/// A `MONITOR` connection counting client-issued commands by name. Commands that scripts run
/// (shown as `[0 lua]`) are not counted: a script call is one command, as the client sees it.
/// The connection is closed when dropped.
pub struct Monitor {
    stream: TcpStream,
    counts: Arc<Mutex<BTreeMap<String, u64>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Monitor {
    /// Starts monitoring the Redis on `127.0.0.1:port`; returns once Redis has confirmed.
    pub fn start(port: u16) -> Monitor {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect for MONITOR");
        stream.write_all(b"MONITOR\r\n").expect("send MONITOR");
        let mut reader = BufReader::new(stream.try_clone().expect("clone socket"));
        let mut ok = String::new();
        reader.read_line(&mut ok).expect("MONITOR reply");
        assert_eq!(ok.trim_end(), "+OK", "MONITOR refused");
        let counts = Arc::new(Mutex::new(BTreeMap::new()));
        let sink = Arc::clone(&counts);
        let reader = std::thread::spawn(move || {
            for line in reader.lines() {
                let Ok(line) = line else { break };
                if let Some(cmd) = client_command(&line) {
                    *sink.lock().expect("counts").entry(cmd).or_insert(0) += 1;
                }
            }
        });
        Monitor {
            stream,
            counts,
            reader: Some(reader),
        }
    }

    /// Client-issued commands seen so far, by lower-case name.
    pub fn counts(&self) -> BTreeMap<String, u64> {
        self.counts.lock().expect("counts").clone()
    }

    /// All client-issued commands seen so far.
    pub fn total(&self) -> u64 {
        self.counts().values().sum()
    }
}

/// The command of a `MONITOR` line (`+1700000000.123456 [0 127.0.0.1:5555] "EVALSHA" ...`), or
/// None for lines of commands run inside scripts (`[0 lua]`).
fn client_command(line: &str) -> Option<String> {
    let rest = line.strip_prefix('+')?;
    let (_, rest) = rest.split_once('[')?;
    let (origin, rest) = rest.split_once(']')?;
    if origin.ends_with("lua") {
        return None;
    }
    let name = rest.trim_start().strip_prefix('"')?.split('"').next()?;
    Some(name.to_ascii_lowercase())
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::client_command;

    #[test]
    fn monitor_lines_are_split_into_client_and_script_commands() {
        let client = r#"+1733300000.123456 [0 127.0.0.1:40000] "EVALSHA" "abc" "1" "k""#;
        assert_eq!(client_command(client).as_deref(), Some("evalsha"));
        let unix = r#"+1733300000.123456 [0 unix:/tmp/r.sock] "ping""#;
        assert_eq!(client_command(unix).as_deref(), Some("ping"));
        let script = r#"+1733300000.123457 [0 lua] "TIME""#;
        assert_eq!(client_command(script), None);
        assert_eq!(client_command("+OK"), None);
    }
}
