#!/usr/bin/env bash
# Installs Chromium for the browser test (tests/test_browser.py), through Debian/Ubuntu apt.
#   bash scripts/install_browser.sh
# Idempotent and never fatal: it does nothing when a Chromium is already there, and when it
# cannot install one (no apt, not root and no password-less sudo, no network) it says why and
# exits 0; the browser test then skips with its own reason. The Python side (playwright) comes
# from requirements-dev.txt; Playwright's own browser download is not used: it drives the
# system's Chromium (NBDDP_CHROMIUM, default /usr/bin/chromium).
set -u

say() { echo "install_browser: $*"; }

for candidate in "${NBDDP_CHROMIUM:-}" /usr/bin/chromium /usr/bin/chromium-browser; do
  if [ -n "$candidate" ] && [ -x "$candidate" ]; then
    say "Chromium already installed ($candidate): nothing to do"
    exit 0
  fi
done

if [ "${NBDDP_NO_BROWSER_INSTALL:-0}" = "1" ]; then
  say "skipped: NBDDP_NO_BROWSER_INSTALL=1 (the browser test will skip)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  say "skipped: no apt-get on this system; install Chromium yourself to run the browser test"
  exit 0
fi
if [ "$(id -u)" = "0" ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  say "skipped: installing packages needs root (or password-less sudo); run: sudo apt-get install -y chromium"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# Ubuntu's "chromium-browser" is a snap wrapper that does not run in containers: Debian's
# "chromium" package is the one tested.
if ! apt-cache show chromium >/dev/null 2>&1; then
  say "refreshing the apt package lists"
  if ! timeout 300 "${SUDO[@]}" apt-get update -qq >/dev/null 2>&1; then
    say "skipped: apt-get update failed (no network or no apt source?)"
    exit 0
  fi
fi
if ! apt-cache show chromium >/dev/null 2>&1; then
  say "skipped: no 'chromium' package in the apt sources"
  exit 0
fi
say "installing chromium with apt-get (a few minutes the first time)"
# A fresh name (mktemp: O_EXCL, mode 0600), never a fixed one: in a shared /tmp any user may have put
# a link at a fixed name, and root writing through it overwrites the file it points to.
LOG=$(mktemp -t nbddp-install-browser.XXXXXXXX) || { say "skipped: mktemp failed"; exit 0; }
if timeout 900 "${SUDO[@]}" apt-get install -y -qq --no-install-recommends chromium >"$LOG" 2>&1; then
  say "installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
  rm -f "$LOG"
else
  say "skipped: apt-get install chromium failed; its output: $LOG"
  tail -n 5 "$LOG" 2>/dev/null | sed 's/^/install_browser:   /'
fi
exit 0
