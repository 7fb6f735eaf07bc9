// Refreshes the page's [data-refresh] section in place every data-refresh seconds: fetches the
// same URL and swaps in the new section (DOMParser runs no script). The page dims while the
// server cannot be reached, so a wall screen never shows stale figures as current.
(function () {
  "use strict";
  var live = document.querySelector("[data-refresh]");
  var every = live ? Number(live.getAttribute("data-refresh")) * 1000 : 0;
  if (!every) return;
  function tick() {
    if (document.hidden) { setTimeout(tick, every); return; }
    fetch(location.href, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { if (!r.ok) throw new Error(r.status); return r.text(); })
      .then(function (html) {
        var doc = new DOMParser().parseFromString(html, "text/html");
        var fresh = doc.querySelector("[data-refresh]");
        if (fresh) { live.replaceWith(fresh); live = fresh; }
        document.body.classList.remove("stale");
      })
      .catch(function () { document.body.classList.add("stale"); })
      .then(function () { setTimeout(tick, every); });
  }
  setTimeout(tick, every);
})();
