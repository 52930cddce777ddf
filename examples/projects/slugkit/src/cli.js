'use strict';
const { slugify } = require('./slug');

for (const title of process.argv.slice(2)) console.log(slugify(title));
