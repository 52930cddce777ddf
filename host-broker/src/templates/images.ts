import type { Logger } from '../../../guest-agent/src/log.ts';
import { withTemplateRoot, type ResolvedGuestImage } from '../vm/guest-image.ts';
import { SnapshotStore } from '../vm/snapshot-store.ts';
import type { VmmDriver } from '../vm/vmm.ts';
import { DEFAULT_TEMPLATE, TemplateStore, validateTemplateName } from './store.ts';

export interface TemplateImage {
  name: string;
  image: ResolvedGuestImage;
  /** The template's own pristine snapshots (and so its own slot lineage). */
  snapshots: SnapshotStore;
}

/**
 * What the qemu backend boots for a session's template: the default template is the
 * backend's own image; a named one is looked up in the data dir on every call (so templates
 * built while the broker runs are seen), combined with the backend's kernel and agent layer,
 * with a SnapshotStore rooted in the template's directory.
 */
export class TemplateImages {
  private readonly byId = new Map<string, TemplateImage>();
  readonly store: TemplateStore;

  constructor(
    private readonly defaultImage: TemplateImage,
    dataDir: string,
    private readonly driver: VmmDriver,
    private readonly log: Logger,
  ) {
    this.store = new TemplateStore(dataDir);
  }

  get(name: string | undefined): TemplateImage {
    if (name === undefined || name === DEFAULT_TEMPLATE) return this.defaultImage;
    const entry = this.store.resolve(validateTemplateName(name));
    const id = entry.manifest.id;
    let t = this.byId.get(id);
    if (!t) {
      t = {
        name,
        image: withTemplateRoot(this.defaultImage.image.base, { rootfs: entry.rootfs, id, name }),
        snapshots: new SnapshotStore(entry.dir, this.driver, this.log),
      };
      this.byId.set(id, t);
    }
    return t;
  }
}
