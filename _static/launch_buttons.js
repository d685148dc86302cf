// sphereml: the Binder / Colab launch buttons only on chapter pages (notebooks/...): the reference pages
// (book/...) are executed Markdown, which Colab cannot open.
document.addEventListener("DOMContentLoaded", () => {
  if (/\/notebooks\//.test(window.location.pathname)) return;
  document.querySelectorAll(".dropdown-launch-buttons").forEach(button => button.remove());
});
