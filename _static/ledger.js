// sphereml: sort and filter the claims ledger (book/claims.md, table#claims-table); a no-op on other pages.
// Clicking a column heading sorts by it (again: the other way); typing in #claims-filter keeps the rows
// whose text contains every word typed.  A cell's data-sort attribute, where present, is its sort key.
document.addEventListener("DOMContentLoaded", () => {
  const table = document.getElementById("claims-table");
  if (!table) return;
  const body = table.tBodies[0];
  const key = (row, column) => {
    const cell = row.cells[column];
    return (cell.dataset.sort || cell.textContent).trim().toLowerCase();
  };
  [...table.tHead.rows[0].cells].forEach((heading, column) => {
    heading.tabIndex = 0;
    const sort = () => {
      const ascending = heading.getAttribute("aria-sort") !== "ascending";
      [...table.tHead.rows[0].cells].forEach(h => h.removeAttribute("aria-sort"));
      heading.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      const rows = [...body.rows].sort((a, b) =>
        key(a, column).localeCompare(key(b, column), undefined, {numeric: true}) * (ascending ? 1 : -1));
      rows.forEach(row => body.appendChild(row));
    };
    heading.addEventListener("click", sort);
    heading.addEventListener("keydown", event => { if (event.key === "Enter") sort(); });
  });
  const filter = document.getElementById("claims-filter");
  if (filter) {
    filter.addEventListener("input", () => {
      const words = filter.value.toLowerCase().split(/\s+/).filter(Boolean);
      [...body.rows].forEach(row => {
        const text = row.textContent.toLowerCase();
        row.hidden = !words.every(word => text.includes(word));
      });
    });
  }
});
