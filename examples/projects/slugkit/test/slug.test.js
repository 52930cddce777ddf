'use strict';
const test = require('node:test');
const assert = require('node:assert');
const { slugify, uniqueSlug } = require('../src/slug');

test('lower-cases and dashes words', () => {
  assert.strictEqual(slugify('Hello World'), 'hello-world');
});

test('drops accents', () => {
  assert.strictEqual(slugify('Crème Brûlée'), 'creme-brulee');
});

test('collapses punctuation runs into one dash', () => {
  assert.strictEqual(slugify('Hello, World!'), 'hello-world');
});

test('numbers a slug that is taken', () => {
  assert.strictEqual(uniqueSlug('Hello World', new Set(['hello-world', 'hello-world-2'])), 'hello-world-3');
});
