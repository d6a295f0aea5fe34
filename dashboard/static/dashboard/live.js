// Keeps the /admin dashboard live: every few seconds, fetch the panels-only
// fragment (/admin/panels/, staff only) and swap it in — no full reload, no
// framework. A failed fetch or an expired session (the admin redirects to its
// login page) leaves the last panels in place and says so.
(function () {
  "use strict";
  function start() {
    var fleet = document.getElementById("fleet");
    var panels = document.getElementById("fleet-panels");
    var status = document.getElementById("live-status");
    if (!fleet || !panels || !window.fetch) return;
    var url = fleet.dataset.panelsUrl;
    var every = parseInt(fleet.dataset.refreshMs, 10) || 5000;

    function say(text, stale) {
      status.textContent = text;
      status.classList.toggle("stale", stale);
    }

    function tick() {
      // A hidden tab need not poll; it catches up on the next tick once visible.
      if (document.hidden) return schedule();
      fetch(url, { credentials: "same-origin", cache: "no-store", headers: { "X-Requested-With": "fetch" } })
        .then(function (response) {
          if (response.redirected || !response.ok) {
            throw new Error(response.redirected ? "session expired: reload to log in" : "HTTP " + response.status);
          }
          return response.text();
        })
        .then(function (html) {
          panels.innerHTML = html;
          panels.dataset.refreshes = String((parseInt(panels.dataset.refreshes, 10) || 0) + 1);
          say("Live: panels refreshed at " + new Date().toLocaleTimeString() + ".", false);
        })
        .catch(function (error) {
          say("Live updates paused (" + error.message + "); the panels below may be stale.", true);
        })
        .then(schedule);
    }

    // setTimeout after each answer, not setInterval: a slow server never gets overlapping requests.
    function schedule() {
      window.setTimeout(tick, every);
    }
    schedule();
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
