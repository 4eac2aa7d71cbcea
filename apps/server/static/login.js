// The login form's script (served without the token). A file, never inline: the CSP runs 'self' scripts only.
document.getElementById("login").addEventListener("submit", async (event) => {
  event.preventDefault();
  const error = document.getElementById("error");
  error.textContent = "";
  try {
    const r = await fetch("/v1/edgekv/login", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({token: document.getElementById("token").value}), credentials: "same-origin"});
    if (r.ok) { location.reload(); return; }
    const body = await r.json().catch(() => ({}));
    error.textContent = (body.error && body.error.message) || ("sign-in failed: HTTP " + r.status);
  } catch (e) {
    error.textContent = "the daemon did not answer (stopped?)";
  }
});
