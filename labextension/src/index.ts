// sandbox-kernel's JupyterLab extension: the Sandboxes side panel and the status bar item.
import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { PathExt } from '@jupyterlab/coreutils';
import { IDocumentManager } from '@jupyterlab/docmanager';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { SandboxesPanel } from './panel';
import { SandboxStatus } from './statusbar';

const OPEN_PANEL = 'sandbox-kernel:open-panel';

const sandboxIcon = new LabIcon({
  name: 'sandbox-kernel:sandbox',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">' +
    '<g class="jp-icon3" fill="#616161"><path d="M3 7l9-4 9 4v10l-9 4-9-4V7zm2 1.3v7.4l6 2.7v-7.4L5 8.3zm8 ' +
    '10.1l6-2.7V8.3l-6 2.7v7.4zM6.2 6.8L12 9.4l5.8-2.6L12 4.2 6.2 6.8z"/></g></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'sandbox-kernel-panel:plugin',
  description: 'The Sandboxes panel and status bar item of sandbox-kernel',
  autoStart: true,
  requires: [INotebookTracker, IDocumentManager],
  optional: [IStatusBar, ILabShell],
  activate: (
    app: JupyterFrontEnd,
    notebooks: INotebookTracker,
    documents: IDocumentManager,
    statusBar: IStatusBar | null
  ) => {
    const kernel = () => notebooks.currentWidget?.sessionContext.session?.kernel ?? null;
    const panel = new SandboxesPanel({
      kernelId: () => kernel()?.id ?? null,
      kernelName: () => kernel()?.name ?? null,
      directory: () => {
        const path = notebooks.currentWidget?.context.path;
        return path ? PathExt.dirname(path) : '';
      },
      open: path => void documents.openOrReveal(path)
    });
    panel.title.icon = sandboxIcon;
    app.shell.add(panel, 'right', { rank: 600 });

    app.commands.addCommand(OPEN_PANEL, {
      label: 'Show the Sandboxes panel',
      execute: () => app.shell.activateById(panel.id)
    });

    if (statusBar) {
      const status = new SandboxStatus(() => void app.commands.execute(OPEN_PANEL));
      const follow = () => status.follow(kernel()?.id ?? null);
      notebooks.currentChanged.connect((_, widget) => {
        follow();
        widget?.sessionContext.kernelChanged.connect(follow);
      });
      follow();
      statusBar.registerStatusItem('sandbox-kernel-panel:status', {
        item: status,
        align: 'left',
        rank: 5,
        isActive: () => true
      });
    }
  }
};

export default plugin;
