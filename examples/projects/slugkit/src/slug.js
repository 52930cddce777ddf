'use strict';

/** Lower-case ASCII slug: letters and digits kept, every other run becomes one dash. */
function slugify(title) {
  return String(title)
    .normalize('NFKD')
    .replace(/[\u0300-\u036f]/g, '')
    .toLowerCase()
    .replace(/[^a-z0-9]/g, '-')
    .replace(/^-+|-+$/g, '');
}

/** Appends -2, -3, ... until the slug is not in `taken`. */
function uniqueSlug(title, taken) {
  const base = slugify(title);
  let slug = base;
  for (let n = 2; taken.has(slug); n++) slug = `${base}-${n}`;
  return slug;
}

module.exports = { slugify, uniqueSlug };
